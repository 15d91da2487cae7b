"""Turning a `Sequence` into model inputs: conditioning-image encodings and token embeddings.

Both the AR and the DiT go through `embed_span`, so the same token gets the same embedding in
both stages (text ids, `<timestep>` with t, VAE latent tokens, ViT tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from .sequence import CondImage, Sequence, SequenceBuilder
from .transformer import HunyuanImage3ForCausalMM


@dataclass
class EncodedImage:
    """One conditioning image, encoded once per request. Its footprint alone (latents and ViT tokens
    None) on a pipeline stage that never embeds it (`ARScheduler` under stages)."""

    footprint: CondImage
    latents: torch.Tensor | None  # [1, C, h, w]
    vit_tokens: torch.Tensor | None  # [vit_len, hidden]


@dataclass
class FittedImage:
    """A conditioning image prepared on the host for both encoders, with its token footprint."""

    footprint: CondImage
    vae_input: Image.Image  # resized and cropped to its ratio bucket
    vit_input: object  # vit.ViTInput


def request_generator(model: HunyuanImage3ForCausalMM, seed: int) -> torch.Generator:
    """A request's random stream, on the model's device as the official `prepare_model_inputs`:
    the conditioning images' VAE posterior draws come first, then (DiT) the initial noise."""
    return torch.Generator(device=model.device).manual_seed(seed)


@torch.no_grad()
def skip_cond_draws(model: HunyuanImage3ForCausalMM, grids: list[tuple[int, int]], generator: torch.Generator) -> None:
    """Advance `generator` past the posterior draws that encoding these images would take, so the
    noise that follows is the official one when the DiT reuses the AR's K/V instead of encoding."""
    from diffusers.utils.torch_utils import randn_tensor

    vae = model.vae
    dtype = vae.dtype
    if model.device.type == "cuda" and vae.autocast_dtype is not None:
        dtype = vae.autocast_dtype  # the encoder's moments come out of fp16 autocast
    for h, w in grids:  # each conditioning image's latent grid
        randn_tensor((1, model.config.vae.latent_channels, 1, h, w), generator=generator, device=model.device,
                     dtype=dtype)


@torch.no_grad()
def encode_cond_images(model: HunyuanImage3ForCausalMM, builder: SequenceBuilder, images: list[Image.Image],
                       infer_align_image_size: bool = False,
                       generator: torch.Generator | None = None) -> list[EncodedImage]:
    """Each image as the official image processor takes it (`get_image_with_size(return_type="vae_vit")`):

    - VAE: the bucket of the nearest aspect ratio among all of them, extra resolutions included
      (`get_target_size` on the original size), Lanczos `resize_and_crop` to it: center crop, or a
      plain stretch with `infer_align_image_size`; then VAE-encoded;
    - ViT: the original image through the SigLIP2 processor (patches padded to `max_num_patches`).

    The VAE latents are a posterior draw (`latent_dist.sample(generator)`), image after image from
    the request's generator.
    """
    return encode_fitted(model, fit_cond_images(model, builder, images, infer_align_image_size), generator)


def fit_cond_images(model: HunyuanImage3ForCausalMM, builder: SequenceBuilder, images: list[Image.Image],
                    infer_align_image_size: bool = False) -> list[FittedImage]:
    """The host half of `encode_cond_images`: each image fitted for the VAE and the ViT, and the
    tokens it takes (its footprint), without running either encoder."""
    from .image_processing import load_image, resize_and_crop
    from .vit import ViTProcessorSettings, preprocess_for_vit

    vit_settings = ViTProcessorSettings.from_config(model.config)
    factor = model.config.vae.downsample_factor
    out = []
    for image in images:
        image = load_image(image)
        ratio = builder.resolutions.ratio_index(*image.size)
        width, height = builder.resolutions.size(ratio)
        fitted = resize_and_crop(image, width, height, "resize" if infer_align_image_size else "center")
        vit_in = preprocess_for_vit(image, vit_settings)
        footprint = CondImage(height // factor, width // factor, ratio, tuple(vit_in.spatial_shape),
                              model.config.vit.max_num_patches, orig_width=image.width, orig_height=image.height)
        out.append(FittedImage(footprint, fitted, vit_in))
    return out


@torch.no_grad()
def encode_fitted(model: HunyuanImage3ForCausalMM, fitted: list[FittedImage],
                  generator: torch.Generator | None = None) -> list[EncodedImage]:
    """The device half of `encode_cond_images`: the VAE latents (a posterior draw from `generator`,
    image after image) and the aligned ViT tokens."""
    from .image_processing import pil_to_tensor
    from .vit import encode_vit

    out = []
    for image in fitted:
        pixels = pil_to_tensor(image.vae_input).unsqueeze(0).to(model.device)
        latents = model.vae.encode(pixels, generator=generator).float()
        vit_tokens = encode_vit(model.vision_model, model.vision_aligner, [image.vit_input])[0].to(model.dtype)
        got = (latents.shape[2], latents.shape[3], vit_tokens.shape[0])
        fp = image.footprint
        if got != (fp.latent_h, fp.latent_w, fp.vit_len):  # the footprint is what the sequence reserves
            raise RuntimeError(f"encoded image takes {got} (latent h, w, ViT tokens), its footprint says "
                               f"{(fp.latent_h, fp.latent_w, fp.vit_len)}")
        out.append(EncodedImage(fp, latents, vit_tokens))
    return out


def embed_span(model: HunyuanImage3ForCausalMM, ids: list[int], seq: Sequence, start: int, end: int,
               cond: list[EncodedImage], gen_latents: torch.Tensor | None = None,
               gen_t: torch.Tensor | None = None) -> torch.Tensor:
    """Embeddings [end - start, H] for tokens [start, end) of one row of `seq`.

    Conditioning images use t = 0 (clean); the generated image's `<timestep>` and latent tokens use
    `gen_t` / `gen_latents` [1, C, h, w] and are needed only when the span covers them.
    """
    device = model.device
    x = model.embed_ids(torch.tensor(ids[start:end], device=device)).clone()

    def put(pos: int, values: torch.Tensor) -> None:
        """Scatter rows `values` that belong at sequence positions [pos, pos + len) into the span."""
        lo, hi = max(pos, start), min(pos + values.shape[0], end)
        if lo < hi:
            x[lo - start:hi - start] = values[lo - pos:hi - pos].to(x.dtype)

    zero = torch.zeros(1, device=device)
    for slot, enc in zip(seq.cond_images, cond):
        if slot.end <= start or slot.timestep_index >= end:
            continue
        put(slot.timestep_index, model.timestep_tokens(zero))
        put(slot.start, model.image_tokens(enc.latents, zero)[0])
        put(slot.vit_start, enc.vit_tokens)
    gen = seq.gen_image
    if gen is not None and gen.timestep_index < end and gen.end > start:
        if gen_latents is None or gen_t is None:
            raise ValueError("span covers the generated image: gen_latents and gen_t are required")
        put(gen.timestep_index, model.timestep_tokens(gen_t))
        put(gen.start, model.image_tokens(gen_latents, gen_t)[0])
    return x
