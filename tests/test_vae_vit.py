"""VAE, SigLIP2 tower, aligner and pixel helpers: shapes, determinism, masking, official names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from components.engine.config import full_config, tiny_config
from components.engine.image_processing import pil_to_tensor, resize_center_crop, tensor_to_pil
from components.engine.vae import _channels_to_space_time, _space_time_to_channels, build_vae
from components.engine.vit import (
    LightProjector,
    ViTInput,
    build_vision_model,
    encode_vit,
    naflex_target_size,
    preprocess_for_vit,
)


def _random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny():
    return tiny_config()


@pytest.fixture(scope="module")
def vae(tiny):
    torch.manual_seed(0)
    return build_vae(tiny.vae).eval()


@pytest.fixture(scope="module")
def vit(tiny):
    torch.manual_seed(0)
    vision_model = build_vision_model(tiny.vit).eval()
    aligner = LightProjector(tiny.vit.hidden_size, tiny.hidden_size, tiny.vit.aligner_depth).eval()
    return vision_model, aligner


# ---------------------------------------------------------------- VAE


@pytest.mark.parametrize("height,width", [(64, 64), (256, 128)])
def test_vae_shapes_roundtrip(vae, tiny, height, width):
    x = torch.rand(2, 3, height, width) * 2 - 1
    z = vae.encode(x)
    assert z.shape == (2, tiny.vae.latent_channels, height // 16, width // 16)
    assert z.dtype == torch.float32
    y = vae.decode(z)
    assert y.shape == (2, 3, height, width)
    assert torch.isfinite(y).all()


def test_vae_encode_deterministic_and_per_sample(vae):
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    z1, z2 = vae.encode(x, sample_posterior=False), vae.encode(x, sample_posterior=False)
    torch.testing.assert_close(z1, z2, rtol=0, atol=0)
    # batching does not mix samples
    torch.testing.assert_close(vae.encode(x[1:], sample_posterior=False), z1[1:], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(z1[0], z1[1])


def test_vae_posterior_sampling(vae):
    """The official `vae_encode` draws `latent_dist.sample(generator)`: encode samples by default."""
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    mean = vae.encode(x, sample_posterior=False)
    a = vae.encode(x, generator=torch.Generator().manual_seed(1))
    b = vae.encode(x, generator=torch.Generator().manual_seed(1))
    c = vae.encode(x, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c) and not torch.equal(a, mean)
    # the spread comes from the encoder's log-variance half: samples centre on the mean
    draws = vae.encode(x.expand(32, -1, -1, -1), sample_posterior=True)
    assert (draws.mean(0) - mean[0]).abs().mean() < (draws - mean).abs().mean() / 3


def test_vae_scaling_and_shift_are_applied(tiny):
    torch.manual_seed(0)
    base = build_vae(tiny.vae).eval()
    scaled_cfg = tiny.vae.__class__(**{**tiny.vae.__dict__, "scaling_factor": 0.5, "shift_factor": 0.25})
    scaled = build_vae(scaled_cfg).eval()
    scaled.load_state_dict(base.state_dict())
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    torch.testing.assert_close(scaled.encode(x, sample_posterior=False), (base.encode(x, sample_posterior=False) - 0.25) * 0.5)
    z = torch.randn(1, tiny.vae.latent_channels, 2, 2)
    # decode inverts the scaling before the decoder
    torch.testing.assert_close(scaled.decode((z - 0.25) * 0.5), base.decode(z), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("r1", [1, 2])
def test_dcae_rearrange_layout(r1):
    """Space-to-channel follows the official einops pattern
    `b c (f r1) (h r2) (w r3) -> b (r1 r2 r3 c) f h w`, and channel-to-space is its inverse."""
    b, c, f, h, w = 1, 3, 2 * r1, 4, 6
    x = torch.randn(b, c, f, h, w)
    y = _space_time_to_channels(x, r1)
    assert y.shape == (b, r1 * 4 * c, f // r1, h // 2, w // 2)
    for ci, fi, hi, wi in [(0, 0, 0, 0), (2, f - 1, h - 1, w - 1), (1, r1 - 1, 1, 4), (2, 1, 3, 2)]:
        i, j, k = fi % r1, hi % 2, wi % 2
        channel = ((i * 2 + j) * 2 + k) * c + ci
        assert y[0, channel, fi // r1, hi // 2, wi // 2] == x[0, ci, fi, hi, wi]
    torch.testing.assert_close(_channels_to_space_time(y, r1), x, rtol=0, atol=0)


def test_vae_time_folding(vae, tiny):
    """An image enters as ffactor_temporal frames that the encoder folds to one latent frame; the
    decoder unfolds one latent frame back to ffactor_temporal frames."""
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    frames = x.unsqueeze(2).expand(-1, -1, vae.ffactor_temporal, -1, -1)
    assert vae.encoder(frames).shape == (1, 2 * tiny.vae.latent_channels, 1, 2, 2)
    z = torch.randn(1, tiny.vae.latent_channels, 1, 2, 2)
    out = vae.decoder(z)
    assert out.shape == (1, 3, vae.ffactor_temporal, 32, 32)
    torch.testing.assert_close(vae.decode(z[:, :, 0]), out[:, :, -1])


def test_vae_rejects_unaligned_size(vae):
    with pytest.raises(ValueError, match="spatial size 40x64 must be a multiple of"):
        vae.encode(torch.zeros(1, 3, 40, 64))


def test_vae_official_names():
    with torch.device("meta"):
        vae = build_vae(full_config().vae)
    keys = set(vae.state_dict())
    expected = {
        "encoder.conv_in.weight",
        "encoder.down.0.block.0.norm1.weight",
        "encoder.down.0.block.0.conv1.weight",
        "encoder.down.0.downsample.conv.weight",
        "encoder.mid.block_1.conv2.weight",
        "encoder.mid.attn_1.q.weight",
        "encoder.mid.attn_1.proj_out.weight",
        "encoder.norm_out.weight",
        "encoder.conv_out.weight",
        "decoder.conv_in.weight",
        "decoder.mid.attn_1.norm.weight",
        "decoder.up.0.block.2.conv1.weight",
        "decoder.up.0.upsample.conv.weight",
        "decoder.up.4.block.0.norm2.bias",
        "decoder.conv_out.weight",
    }
    assert expected <= keys, sorted(expected - keys)
    # 4 levels downsample (16x), the last one does not
    assert "encoder.down.4.downsample.conv.weight" not in keys
    assert "decoder.up.4.upsample.conv.weight" not in keys


def test_vae_full_size_on_meta():
    cfg = full_config().vae
    with torch.device("meta"):
        vae = build_vae(cfg)
    sd = vae.state_dict()
    n = sum(p.numel() for p in vae.parameters())
    print(f"\nVAE full: {n / 1e6:.1f}M params "
          f"(encoder {sum(p.numel() for p in vae.encoder.parameters()) / 1e6:.1f}M)")
    # 3x3x3 conv kernels, latent moments 2*32
    assert sd["encoder.conv_in.weight"].shape == (128, 3, 3, 3, 3)
    assert sd["encoder.conv_out.weight"].shape == (64, 1024, 3, 3, 3)
    assert sd["decoder.conv_in.weight"].shape == (1024, 32, 3, 3, 3)
    # DC-AE samplers: spatial-only level 0 (factor 4), spatio-temporal level 3 (factor 8)
    assert sd["encoder.down.0.downsample.conv.weight"].shape == (256 // 4, 128, 3, 3, 3)
    assert sd["encoder.down.3.downsample.conv.weight"].shape == (1024 // 8, 1024, 3, 3, 3)
    assert sd["decoder.up.0.upsample.conv.weight"].shape == (1024 * 8, 1024, 3, 3, 3)
    assert sd["decoder.up.3.upsample.conv.weight"].shape == (128 * 4, 256, 3, 3, 3)
    assert 1.0e9 < n < 1.5e9


# ---------------------------------------------------------------- ViT preprocessing


@pytest.mark.parametrize("size", [(64, 64), (300, 100), (100, 300), (1000, 17), (17, 1000), (5, 5), (2048, 1536)])
def test_preprocess_fits_budget(tiny, size):
    cfg = tiny.vit
    inp = preprocess_for_vit(_random_image(*size), cfg)
    h, w = inp.spatial_shape
    per_patch = cfg.num_channels * cfg.patch_size**2
    assert inp.pixel_values.shape == (cfg.max_num_patches, per_patch)
    assert inp.attention_mask.shape == (cfg.max_num_patches,)
    assert 1 <= h * w <= cfg.max_num_patches
    assert int(inp.attention_mask.sum()) == h * w == inp.num_valid
    assert inp.attention_mask[: h * w].all() and not inp.attention_mask[h * w :].any()
    assert inp.pixel_values[h * w :].abs().sum() == 0
    assert inp.pixel_values.min() >= -1 and inp.pixel_values.max() <= 1
    # aspect ratio kept within one patch of rounding
    width, height = size
    assert abs(w / h - width / height) <= (width / height) * (1 / h + 1 / w) + 1e-6 or min(h, w) == 1


def test_preprocess_full_budget_uses_most_patches():
    cfg = full_config().vit
    for width, height in [(1024, 1024), (1280, 720), (768, 1024)]:
        h, w = naflex_target_size(height, width, cfg.patch_size, cfg.max_num_patches)
        n = (h // 16) * (w // 16)
        assert cfg.max_num_patches * 0.85 < n <= cfg.max_num_patches
    assert naflex_target_size(1024, 1024, 16, 729) == (27 * 16, 27 * 16)


def test_preprocess_matches_transformers_processor(tiny):
    """The official code runs transformers' Siglip2ImageProcessorFast (torchvision's uint8 antialiased
    bilinear resize; torchvision cannot be installed beside this torch). Its resize matches PIL's bilinear
    within one grey level, so against the PIL processor: same grid and mask, pixels within 1/127.5."""
    pil_proc = pytest.importorskip("transformers.models.siglip2.image_processing_pil_siglip2")
    cfg = tiny.vit
    images = [_random_image(300, 100, 1), _random_image(64, 64, 2), _random_image(33, 250, 3)]
    ref = pil_proc.Siglip2ImageProcessorPil(patch_size=cfg.patch_size, max_num_patches=cfg.max_num_patches)(
        images, return_tensors="pt"
    )
    for i, image in enumerate(images):
        ours = preprocess_for_vit(image, cfg)
        assert tuple(ref["spatial_shapes"][i].tolist()) == ours.spatial_shape
        torch.testing.assert_close(ours.pixel_values, ref["pixel_values"][i].float(), rtol=0, atol=1 / 127.5 + 1e-6)
        assert torch.equal(ours.attention_mask, ref["pixel_attention_mask"][i].long())


def test_vit_resize_is_torchvisions_uint8_kernel():
    """torchvision's resize_image: the native uint8 kernel on AVX2, else float -> round: within one level."""
    from components.engine.vit import resize_uint8_bilinear

    x = torch.from_numpy(np.array(_random_image(151, 97, 4))).permute(2, 0, 1).contiguous()
    ours = resize_uint8_bilinear(x, 64, 96)
    assert ours.dtype == torch.uint8 and ours.shape == (3, 64, 96)
    via_float = torch.nn.functional.interpolate(x[None].float(), size=[64, 96], mode="bilinear", align_corners=False,
                                                antialias=True).round()[0]
    assert (ours.float() - via_float).abs().max() <= 1
    assert resize_uint8_bilinear(x, 97, 151) is x  # no resize when the size already fits


def test_vit_padding_length_comes_from_the_checkpoint_vit_processor(tiny):
    """Official: ViT tokens are padded to `vit_processor.max_num_patches` (image_processor.py ViTInfo
    max_token_length; 1024 in the released Instruct config), not to 729."""
    from types import SimpleNamespace

    from components.engine.vit import ViTProcessorSettings

    released = SimpleNamespace(vit=full_config().vit, vit_processor={"max_num_patches": 1024, "patch_size": 16,
                                                                      "resample": 2})
    settings = ViTProcessorSettings.from_config(released)
    assert (settings.max_num_patches, settings.patch_size) == (1024, 16)
    inp = preprocess_for_vit(_random_image(1280, 720), settings)
    assert inp.pixel_values.shape == (1024, 768) and inp.attention_mask.shape == (1024,)
    h, w = inp.spatial_shape
    assert 0.85 * 1024 < h * w <= 1024 and w > h
    # without the key, the ViT config's value is used
    assert ViTProcessorSettings.from_config(tiny).max_num_patches == tiny.vit.max_num_patches
    with pytest.raises(ValueError, match="bilinear"):
        ViTProcessorSettings.from_config(SimpleNamespace(vit=tiny.vit, vit_processor={"resample": 3}))


def test_preprocess_patch_layout(tiny):
    """Patch k is the k-th 16x16 tile in raster order, flattened (row, col, channel)."""
    cfg = tiny.vit
    # 128x128 is exactly the 8x8 = 64 patch budget, so no resize happens
    array = np.zeros((128, 128, 3), dtype=np.uint8)
    array[16:32, 0:16, 0] = 255  # tile (row 1, col 0), red channel
    inp = preprocess_for_vit(Image.fromarray(array), cfg)
    assert inp.spatial_shape == (8, 8)
    tile = inp.pixel_values[8].view(16, 16, 3)
    assert torch.all(tile[..., 0] == 1) and torch.all(tile[..., 1:] == -1)
    others = torch.ones(64, dtype=torch.bool)
    others[8] = False
    assert torch.all(inp.pixel_values[others] == -1)


# ---------------------------------------------------------------- ViT tower + aligner


def test_encode_vit_shape(vit, tiny):
    vision_model, aligner = vit
    inputs = [preprocess_for_vit(_random_image(w, h, i), tiny.vit) for i, (w, h) in enumerate([(64, 64), (200, 50)])]
    out = encode_vit(vision_model, aligner, inputs)
    assert out.shape == (2, tiny.vit.max_num_patches, tiny.hidden_size)
    assert torch.isfinite(out).all()
    # one at a time gives the same rows as the batch
    single = encode_vit(vision_model, aligner, inputs[1:])
    torch.testing.assert_close(single[0], out[1], rtol=1e-4, atol=1e-5)


def test_encode_vit_padding_is_masked(vit, tiny):
    vision_model, aligner = vit
    inp = preprocess_for_vit(_random_image(100, 30), tiny.vit)  # 4x14 = 56 of 64 patches
    n = inp.num_valid
    assert n < tiny.vit.max_num_patches
    noisy = inp.pixel_values.clone()
    noisy[n:] = torch.randn_like(noisy[n:]) * 3
    other = ViTInput(pixel_values=noisy, attention_mask=inp.attention_mask, spatial_shape=inp.spatial_shape)
    a, b = encode_vit(vision_model, aligner, [inp, other])
    torch.testing.assert_close(a[:n], b[:n], rtol=1e-4, atol=1e-5)
    # the check can fail: unmasked, the padding content does reach the valid rows
    unmasked = ViTInput(noisy, torch.ones_like(inp.attention_mask), inp.spatial_shape)
    c = encode_vit(vision_model, aligner, [unmasked])[0]
    assert not torch.allclose(a[:n], c[:n], atol=1e-3)


def test_light_projector_structure():
    proj = LightProjector(8, 16, depth=2)
    assert list(proj.state_dict()) == ["layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"]
    assert isinstance(proj.layers[1], torch.nn.GELU) and proj.layers[1].approximate == "none"
    assert list(LightProjector(8, 16, depth=3).state_dict())[-1] == "layers.4.bias"
    assert proj(torch.zeros(5, 8)).shape == (5, 16)


def test_vision_model_official_names(vit):
    """Exactly the parameter names of the official `Siglip2VisionTransformer` (siglip2.py at fork commit
    4000b7f: embeddings / encoder.layers.N / post_layernorm / head with an nn.MultiheadAttention), so the
    checkpoint's `vision_model.*` tensors load strictly."""
    vision_model, _ = vit
    layer = ["layer_norm1.weight", "layer_norm1.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
             "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
             "self_attn.out_proj.weight", "self_attn.out_proj.bias", "layer_norm2.weight", "layer_norm2.bias",
             "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
    official = {"embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
                "embeddings.position_embedding.weight", "post_layernorm.weight", "post_layernorm.bias",
                "head.probe", "head.attention.in_proj_weight", "head.attention.in_proj_bias",
                "head.attention.out_proj.weight", "head.attention.out_proj.bias", "head.layernorm.weight",
                "head.layernorm.bias", "head.mlp.fc1.weight", "head.mlp.fc1.bias", "head.mlp.fc2.weight",
                "head.mlp.fc2.bias"}
    official |= {f"encoder.layers.{i}.{name}" for i in range(len(vision_model.encoder.layers)) for name in layer}
    assert set(vision_model.state_dict()) == official
    # patch embedding is a Linear over flattened 16x16x3 patches (naflex), not a Conv2d
    assert vision_model.state_dict()["embeddings.patch_embedding.weight"].ndim == 2


def test_vision_full_size_on_meta():
    cfg = full_config()
    with torch.device("meta"):
        vision_model = build_vision_model(cfg.vit)
        aligner = LightProjector(cfg.vit.hidden_size, cfg.hidden_size, cfg.vit.aligner_depth)
    n_vit = sum(p.numel() for p in vision_model.parameters())
    n_head = sum(p.numel() for p in vision_model.head.parameters())
    n_al = sum(p.numel() for p in aligner.parameters())
    print(f"\nViT full: {n_vit / 1e6:.1f}M params (head {n_head / 1e6:.1f}M), aligner {n_al / 1e6:.1f}M")
    sd = vision_model.state_dict()
    assert sd["embeddings.patch_embedding.weight"].shape == (1152, 3 * 16 * 16)
    assert sd["embeddings.position_embedding.weight"].shape == (256, 1152)
    assert "encoder.layers.26.mlp.fc1.weight" in sd and "encoder.layers.27.mlp.fc1.weight" not in sd
    assert sd["encoder.layers.0.mlp.fc1.weight"].shape == (4304, 1152)
    assert aligner.state_dict()["layers.2.weight"].shape == (4096, 4096)
    assert 400e6 < n_vit < 440e6


# ---------------------------------------------------------------- pixel helpers


def test_pil_tensor_roundtrip_lossless():
    image = _random_image(37, 23)
    x = pil_to_tensor(image)
    assert x.shape == (3, 23, 37) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    back = tensor_to_pil(x)
    assert back.mode == "RGB" and back.size == image.size
    assert np.array_equal(np.asarray(back), np.asarray(image))
    # extremes map exactly and out-of-range values are clamped
    edge = tensor_to_pil(torch.tensor([-1.0, 1.0, 5.0]).view(3, 1, 1).expand(3, 2, 2).clone())
    assert np.asarray(edge)[0, 0].tolist() == [0, 255, 255]


@pytest.mark.parametrize("src,dst", [((400, 200), (128, 128)), ((200, 400), (128, 64)), ((100, 100), (256, 128)),
                                     ((640, 480), (640, 480))])
def test_resize_center_crop(src, dst):
    image = _random_image(*src)
    out = resize_center_crop(image, *dst)
    assert out.size == dst and out.mode == "RGB"


def test_resize_center_crop_keeps_center():
    # a wide image with a distinct center stripe: the crop keeps the stripe, drops the sides
    array = np.zeros((100, 300, 3), dtype=np.uint8)
    array[:, 100:200] = 255
    out = np.asarray(resize_center_crop(Image.fromarray(array), 100, 100)).astype(int)
    assert out[:, 10:90].mean() > 250
    same = resize_center_crop(Image.fromarray(array[:, 100:200]), 100, 100)
    assert np.array_equal(np.asarray(same), array[:, 100:200])


def test_resize_mode_stretches_without_cropping():
    """Official infer_align_image_size: crop_type "resize" stretches the whole image to the bucket."""
    from components.engine.image_processing import resize_and_crop

    array = np.zeros((100, 300, 3), dtype=np.uint8)
    array[:, :30] = 255  # a left edge band that a center crop to a square would cut away
    out = np.asarray(resize_and_crop(Image.fromarray(array), 100, 100, "resize")).astype(int)
    assert out.shape == (100, 100, 3) and out[:, :8].mean() > 250
    centre = np.asarray(resize_and_crop(Image.fromarray(array), 100, 100, "center")).astype(int)
    assert centre[:, :8].mean() < 5
    with pytest.raises(ValueError, match="crop"):
        resize_and_crop(Image.fromarray(array), 10, 10, "random")


def test_align_output_size_follows_the_official_postprocess():
    """postprocess_outputs(infer_align_image_size=True): a conditioning image in the output's bucket whose
    own ratio is off by >= 0.01 gives the output its aspect ratio at area base_size**2."""
    from components.engine.image_processing import align_output_size
    from components.engine.sequence import ResolutionGroup

    g = ResolutionGroup(1024)
    out = Image.new("RGB", (1280, 768))
    k = g.ratio_index(1280, 768)
    assert g.ratio_index(1000, 620) == k
    assert align_output_size(out, k, [(k, 1000, 620)], g).size == (1300, 806)  # sqrt(1024^2 / 620000) * (1000, 620)
    assert align_output_size(out, k, [(k, 1000, 600)], g).size == (1280, 768)  # the bucket's own ratio: untouched
    assert align_output_size(out, k, [(k - 1, 1000, 620)], g).size == (1280, 768)  # other bucket: untouched
    # several images: the first one in the output's bucket decides
    assert align_output_size(out, k, [(3, 500, 100), (k, 1000, 620), (k, 1000, 600)], g).size == (1300, 806)


def test_load_image_applies_exif_orientation():
    """transformers' load_image (used by the official processor) applies the EXIF orientation."""
    import io

    from components.engine.image_processing import load_image

    image = Image.new("RGB", (40, 20), "red")
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees
    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif.tobytes())
    assert load_image(Image.open(io.BytesIO(buf.getvalue()))).size == (20, 40)
