"""The conditioning-image vision tower: SigLIP2 so400m-patch16-naflex plus the `LightProjector` aligner.

HunyuanImage-3 feeds every conditioning image to the LLM twice: as VAE latents and as ViT features.
This module holds the ViT half:

- `preprocess_for_vit`: the official processor, transformers' `Siglip2ImageProcessorFast` built from
  the checkpoint's `vit_processor` config: resize keeping the aspect ratio so the patch grid fits
  `max_num_patches` (uint8 bilinear antialiased resize as torchvision does it on the CPU), scale to
  [-1, 1], cut 16x16 patches, pad the run to `max_num_patches` (1024 for the released model);
- `build_vision_model`: transformers' `Siglip2VisionModel` (random init). Its parameter names are the
  official `Siglip2VisionTransformer`'s (siglip2.py): `embeddings.patch_embedding`,
  `embeddings.position_embedding`, `encoder.layers.N.{self_attn.{q,k,v,out}_proj, layer_norm1,
  layer_norm2, mlp.fc1, mlp.fc2}`, `post_layernorm`, `head.{probe, attention.in_proj_weight,
  attention.in_proj_bias, attention.out_proj, layernorm, mlp.fc1, mlp.fc2}`, so the checkpoint's
  `vision_model.*` tensors load strictly. The official tower is built from a config without
  `vision_use_head`, so it carries the attention-pooling `head`; we keep it for a strict load
  although only `last_hidden_state` is used;
- `LightProjector`: the official `vision_aligner` (`layers.0` Linear, GELU, `layers.2` Linear);
- `encode_vit`: batch of preprocessed images -> [B, max_num_patches, llm_hidden] tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from .config import ViTConfig

if TYPE_CHECKING:  # transformers' SigLIP2 module takes seconds to import: only where a tower is built
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

# SigLIP2 normalisation: mean = std = 0.5, i.e. pixels in [-1, 1]
_MEAN = 0.5
_STD = 0.5
# Learned position-embedding table of siglip2-so400m-patch16-naflex is 16x16; naflex resizes it to
# every image's patch grid. ViTConfig has no field for it yet; `getattr` picks one up if added.
DEFAULT_NUM_POSITION_PATCHES = 256


@dataclass
class ViTInput:
    """One preprocessed image, padded to `max_num_patches` patch rows."""

    pixel_values: Tensor  # [max_num_patches, num_channels * patch_size**2], float32
    attention_mask: Tensor  # [max_num_patches], long: 1 for the h*w real patches, 0 for padding
    spatial_shape: tuple[int, int]  # (h_patches, w_patches)

    @property
    def num_valid(self) -> int:
        return self.spatial_shape[0] * self.spatial_shape[1]


@dataclass(frozen=True)
class ViTProcessorSettings:
    """The parts of the checkpoint's `vit_processor` config (a Siglip2ImageProcessorFast dict) we use."""

    patch_size: int = 16
    max_num_patches: int = 1024
    image_mean: tuple[float, float, float] = (_MEAN, _MEAN, _MEAN)
    image_std: tuple[float, float, float] = (_STD, _STD, _STD)

    @classmethod
    def from_config(cls, config) -> "ViTProcessorSettings":
        """From the checkpoint's `vit_processor` dict (`config.vit_processor`, or kept verbatim in
        `config.extra`) where it has a key, else from `config.vit` (`patch_size`, `max_num_patches`)."""
        vit = getattr(config, "vit", config)
        proc = getattr(config, "vit_processor", None) or (getattr(config, "extra", None) or {}).get("vit_processor") \
            or {}
        if not isinstance(proc, dict):
            proc = vars(proc)
        resample = proc.get("resample", 2)
        if resample not in (2, "bilinear", None):
            raise ValueError(f"vit_processor.resample {resample!r}: only bilinear (2) is supported")
        mean = proc.get("image_mean", _MEAN)
        std = proc.get("image_std", _STD)
        return cls(patch_size=int(proc.get("patch_size", vit.patch_size)),
                   max_num_patches=int(proc.get("max_num_patches", vit.max_num_patches)),
                   image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (mean,) * 3,
                   image_std=tuple(std) if isinstance(std, (list, tuple)) else (std,) * 3)


def naflex_target_size(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """Largest aspect-preserving (height, width), each a multiple of `patch_size`, whose patch grid
    has at most `max_num_patches` patches (binary search over the scale, as the SigLIP2 processor)."""

    def scaled(scale: float, size: int) -> int:
        return max(patch_size, int(math.ceil(size * scale / patch_size) * patch_size))

    eps = 1e-5
    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        if (scaled(mid, height) / patch_size) * (scaled(mid, width) / patch_size) <= max_num_patches:
            lo = mid
        else:
            hi = mid
    return scaled(lo, height), scaled(lo, width)


def resize_uint8_bilinear(image: Tensor, height: int, width: int) -> Tensor:
    """torchvision v2 `resize_image(..., BILINEAR, antialias=True)` of a uint8 [C, H, W] CPU tensor:
    the native uint8 kernel on AVX2 CPUs, else float32 -> interpolate -> round -> uint8."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    x = image.unsqueeze(0)
    native = "AVX2" in torch.backends.cpu.get_cpu_capability()
    if not native:
        x = x.float()
    x = torch.nn.functional.interpolate(x, size=[height, width], mode="bilinear", align_corners=False,
                                        antialias=True)
    if not native:
        x = x.round_().to(torch.uint8)
    return x[0]


def preprocess_for_vit(image: Image.Image, settings: ViTProcessorSettings | ViTConfig) -> ViTInput:
    """PIL image (as loaded: EXIF-transposed RGB) -> naflex patches padded to `max_num_patches`,
    as the official `Siglip2ImageProcessorFast(image)`."""
    if isinstance(settings, ViTConfig):
        settings = ViTProcessorSettings(patch_size=settings.patch_size, max_num_patches=settings.max_num_patches)
    p = settings.patch_size
    image = image.convert("RGB")
    height, width = naflex_target_size(image.height, image.width, p, settings.max_num_patches)
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    pixels = resize_uint8_bilinear(pixels, height, width)
    # transformers fuses rescale (1/255) and normalize: (x - 255 * mean) / (255 * std), in float32
    mean = torch.tensor(settings.image_mean, dtype=torch.float32).view(-1, 1, 1) * 255.0
    std = torch.tensor(settings.image_std, dtype=torch.float32).view(-1, 1, 1) * 255.0
    x = (pixels.float() - mean) / std  # [C, H, W]

    h, w = height // p, width // p
    # [C, H, W] -> [h, w, p, p, C] -> [h*w, p*p*C]: patch vectors are (row, col, channel) ordered
    patches = x.reshape(-1, h, p, w, p).permute(1, 3, 2, 4, 0).reshape(h * w, -1)

    pixel_values = torch.zeros(settings.max_num_patches, patches.shape[1], dtype=torch.float32)
    pixel_values[: h * w] = patches
    attention_mask = torch.zeros(settings.max_num_patches, dtype=torch.long)
    attention_mask[: h * w] = 1
    return ViTInput(pixel_values=pixel_values, attention_mask=attention_mask, spatial_shape=(h, w))


def vision_config(cfg: ViTConfig) -> Siglip2VisionConfig:
    from transformers import Siglip2VisionConfig

    config = Siglip2VisionConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_channels=cfg.num_channels,
        patch_size=cfg.patch_size,
        num_patches=int(getattr(cfg, "num_patches", DEFAULT_NUM_POSITION_PATCHES)),
        layer_norm_eps=cfg.layer_norm_eps,
        hidden_act="gelu_pytorch_tanh",
        vision_use_head=True,
    )
    config._attn_implementation = "sdpa"
    return config


def vision_parameter_count(cfg: ViTConfig) -> int:
    """The parameters of `build_vision_model(cfg)`, counted without building it (so without importing
    transformers: the job's memory check needs only this, and that import was a third of the
    checks' time). tests/test_fit.py checks it against the built tower."""
    h, inter, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size
    linear = lambda n_in, n_out: n_in * n_out + n_out  # noqa: E731 - weight and bias
    norm = 2 * h
    mlp = linear(h, inter) + linear(inter, h)
    embeddings = linear(c * p * p, h) + int(getattr(cfg, "num_patches", DEFAULT_NUM_POSITION_PATCHES)) * h
    layer = 4 * linear(h, h) + 2 * norm + mlp  # q, k, v, out projections; two norms; the MLP
    head = h + 3 * h * h + 3 * h + linear(h, h) + norm + mlp  # probe, attention (in_proj, out_proj), norm, MLP
    return embeddings + cfg.num_hidden_layers * layer + norm + head  # the norm: post_layernorm


def build_vision_model(cfg: ViTConfig) -> Siglip2VisionModel:
    """The official `vision_model` (SigLIP2 naflex tower), randomly initialised."""
    from transformers import Siglip2VisionModel

    return Siglip2VisionModel(vision_config(cfg))


class LightProjector(nn.Module):
    """The official `vision_aligner` (`projector_type="mlp_gelu"`): Linear, then (GELU, Linear) x (depth-1)."""

    def __init__(self, vit_hidden: int, llm_hidden: int, depth: int = 2):
        super().__init__()
        modules: list[nn.Module] = [nn.Linear(vit_hidden, llm_hidden)]
        for _ in range(1, depth):
            modules += [nn.GELU(), nn.Linear(llm_hidden, llm_hidden)]
        self.layers = nn.Sequential(*modules)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


@torch.no_grad()
def encode_vit(vision_model: Siglip2VisionModel, aligner: LightProjector, inputs: list[ViTInput]) -> Tensor:
    """Preprocessed images -> aligned tokens [B, max_num_patches, llm_hidden].

    Padding rows are returned too: the sequence reserves `max_num_patches` slots per image. Padding
    keys are masked out, so the valid rows do not depend on what the padding holds."""
    if not inputs:
        raise ValueError("encode_vit needs at least one image")
    weight = vision_model.embeddings.patch_embedding.weight
    device, dtype = weight.device, weight.dtype
    pixel_values = torch.stack([i.pixel_values for i in inputs]).to(device=device, dtype=dtype)
    mask = torch.stack([i.attention_mask for i in inputs]).to(device=device, dtype=torch.long)
    spatial_shapes = torch.tensor([i.spatial_shape for i in inputs], dtype=torch.long, device=device)
    hidden = vision_model(
        pixel_values=pixel_values, pixel_attention_mask=mask, spatial_shapes=spatial_shapes
    ).last_hidden_state
    aligner_dtype = next(aligner.parameters()).dtype
    return aligner(hidden.to(aligner_dtype))
