"""The HunyuanImage-3 image autoencoder (`AutoencoderKLConv3D`).

A DC-AE style KL autoencoder built from 3-D convolutions: the released checkpoint is shared with a
video model, so an image is handled as a short clip. `encode` repeats the frame `ffactor_temporal`
times and the encoder folds time away (T=4 -> 1); `decode` unfolds one latent frame into
`ffactor_temporal` frames and keeps the last one. This mirrors the official
`hunyuan_image_3/autoencoder_kl_3d.py`, so the parameter names below are the checkpoint's `vae.*`
names (`encoder.down.0.block.0.conv1.weight`, `decoder.mid.attn_1.q.weight`, ...).

Only the inference path is kept (no tiling, slicing or gradient checkpointing).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .config import VAEConfig
from .kernels.compiled import call_compiled

# The official modules hard-code GroupNorm(32); a channel width must be a multiple of 32.
NORM_GROUPS = 32


def _normalize(x: Tensor, weight: Tensor, bias: Tensor, num_groups: int, eps: float) -> Tensor:
    """nn.GroupNorm's math in float32: mean and biased variance per (sample, group), then per
    channel y = x * a + b with a = rstd * weight, b = bias - mean * a (as PyTorch's CUDA kernel)."""
    b, c = x.shape[:2]
    xg = x.reshape(b, num_groups, c // num_groups, -1).float()  # [B, G, C/G, T*H*W]
    var, mean = torch.var_mean(xg, dim=(2, 3), correction=0, keepdim=True)
    scale = torch.rsqrt(var + eps) * weight.float().view(1, num_groups, -1, 1)
    shift = bias.float().view(1, num_groups, -1, 1) - mean * scale
    return (xg * scale + shift).reshape(x.shape)


def group_norm(x: Tensor, weight: Tensor, bias: Tensor, num_groups: int, eps: float, dtype: torch.dtype) -> Tensor:
    """F.group_norm(x, num_groups, weight, bias, eps) computed in float32, returned in `dtype`."""
    return _normalize(x, weight, bias, num_groups, eps).to(dtype)


def group_norm_silu(x: Tensor, weight: Tensor, bias: Tensor, num_groups: int, eps: float,
                    dtype: torch.dtype) -> Tensor:
    """F.silu(F.group_norm(...)) computed in float32, returned in `dtype`."""
    return F.silu(_normalize(x, weight, bias, num_groups, eps)).to(dtype)


def fast_norms(x: Tensor) -> bool:
    """Whether the VAE's norms take the compiled path: for inference (no autograd; encode and
    decode run under no_grad) on CUDA, unless the kernel setting `compile=off` (as in
    ARDIT_KERNELS=plain) keeps nn.GroupNorm's own kernel."""
    return x.is_cuda and not torch.is_grad_enabled() and kernels.settings().compile != "off"


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm (same parameters and state-dict names) with a faster CUDA path.

    PyTorch's CUDA group_norm reduces each (sample, group) in one thread block: with batch 1 and 32
    groups only 32 blocks run, which left a 1024x1024 encode spending half its time in the norms.
    On CUDA the same float32 math runs through `torch.compile` instead (split reductions, the
    normalization, affine and SiLU fused into a few kernels). Elsewhere it is nn.GroupNorm."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.affine and fast_norms(x)):
            return super().forward(x)
        # group_norm is a float32 op under autocast: its output stays float32 there
        return self._compiled(group_norm, x, torch.float32 if torch.is_autocast_enabled("cuda") else x.dtype)

    def conv_input(self, x: Tensor, silu: bool = True) -> Tensor:
        """`F.silu(self(x))` (or `self(x)`) as the Conv3d that follows reads it.

        Under float16 autocast the conv casts the float32 norm output to float16 anyway; here that
        cast is fused into the norm's kernel: the conv sees the same float32 formula rounded once
        to float16, as before (only float32 rounding inside differs, mostly the reduction order
        of the statistics), and no float32 tensor is written. Without autocast the conv reads
        the norm's own dtype."""
        if not (self.affine and fast_norms(x)):
            return F.silu(super().forward(x)) if silu else super().forward(x)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return self._compiled(group_norm_silu if silu else group_norm, x, dtype)

    def _compiled(self, fn: Callable[..., Tensor], x: Tensor, dtype: torch.dtype) -> Tensor:
        # As [B, C, T*H*W], detached from x's view chain (no autograd here): one dynamic graph then
        # serves every resolution and frame count (a 5-D input specialises T=1, and dynamo guards
        # on a view's base).
        flat = x.flatten(2).detach()
        y = call_compiled(fn, flat, self.weight, self.bias, self.num_groups, self.eps, dtype, dynamic=0)
        return y.view(x.shape)


def _group_norm(num_groups: int, channels: int) -> GroupNorm:
    if channels % num_groups:
        raise ValueError(f"VAE width {channels} is not a multiple of {num_groups} (official GroupNorm(32))")
    return GroupNorm(num_groups=num_groups, num_channels=channels, eps=1e-6, affine=True)


def _space_time_to_channels(x: Tensor, r1: int) -> Tensor:
    """b c (f r1) (h 2) (w 2) -> b (r1 2 2 c) f h w."""
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // r1, r1, h // 2, 2, w // 2, 2)
    x = x.permute(0, 3, 5, 7, 1, 2, 4, 6)
    return x.reshape(b, r1 * 4 * c, f // r1, h // 2, w // 2)


def _channels_to_space_time(x: Tensor, r1: int) -> Tensor:
    """b (r1 2 2 c) f h w -> b c (f r1) (h 2) (w 2)."""
    b, c, f, h, w = x.shape
    c_out = c // (r1 * 4)
    x = x.reshape(b, r1, 2, 2, c_out, f, h, w)
    x = x.permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(b, c_out, f * r1, h * 2, w * 2)


class Conv3d(nn.Conv3d):
    """nn.Conv3d (same parameters and names) that on the CPU runs as a sum of 2-D convolutions
    over the kernel's time taps: PyTorch's CPU conv3d has no fast kernel (`slow_conv3d` took 85%
    of a tiny decode), while conv2d does. Same function; on GPUs the native cuDNN conv3d runs."""

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda or self.groups != 1 or self.padding_mode != "zeros" or self.stride[0] != 1 \
                or self.dilation[0] != 1:
            return super().forward(x)
        b, c, t, h, w = x.shape
        kt, pt = self.kernel_size[0], self.padding[0]
        t_out = t + 2 * pt - kt + 1
        out = None
        for dt in range(kt):
            # output frame o reads input frame o + dt - pt; frames in the zero padding add nothing,
            # so no padded copy is made (a one-frame image runs only the middle tap)
            o0, o1 = max(0, pt - dt), min(t_out, t + pt - dt)
            if o0 >= o1:
                continue
            n = o1 - o0
            frames = x[:, :, o0 + dt - pt:o1 + dt - pt].transpose(1, 2).reshape(b * n, c, h, w)
            tap = self.weight[:, :, dt].contiguous()  # a strided weight sends conv2d down a slow path
            y = F.conv2d(frames, tap, None, self.stride[1:], self.padding[1:], self.dilation[1:])
            y = y.view(b, n, *y.shape[1:])
            if out is None and n == t_out:
                out = y
                continue
            if out is None:
                out = y.new_zeros(b, t_out, *y.shape[2:])
            out[:, o0:o1] += y
        if self.bias is not None:
            out = out + self.bias.view(1, 1, -1, 1, 1)
        return out.transpose(1, 2)


class AttnBlock(nn.Module):
    """Single-head self-attention over all (f, h, w) positions, 1x1x1 conv projections."""

    def __init__(self, channels: int, norm_num_groups: int):
        super().__init__()
        self.norm = _group_norm(norm_num_groups, channels)
        self.q = Conv3d(channels, channels, kernel_size=1)
        self.k = Conv3d(channels, channels, kernel_size=1)
        self.v = Conv3d(channels, channels, kernel_size=1)
        self.proj_out = Conv3d(channels, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm.conv_input(x, silu=False)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, f, hh, ww = q.shape
        # (b, c, f, h, w) -> (b, 1, f*h*w, c)
        q, k, v = (t.flatten(2).transpose(1, 2).unsqueeze(1) for t in (q, k, v))
        h = F.scaled_dot_product_attention(q, k, v)
        h = h.squeeze(1).transpose(1, 2).reshape(b, c, f, hh, ww)
        return x + self.proj_out(h)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, norm_num_groups: int):
        super().__init__()
        self.norm1 = _group_norm(norm_num_groups, in_channels)
        self.conv1 = Conv3d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = _group_norm(norm_num_groups, out_channels)
        self.conv2 = Conv3d(out_channels, out_channels, kernel_size=3, padding=1)
        # Official name; never built with the released channel plan (channels change only in the
        # down/up samplers) but kept so other plans load the same way.
        self.nin_shortcut = (
            Conv3d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(self.norm1.conv_input(x))
        h = self.conv2(self.norm2.conv_input(h))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class DownsampleDCAE(nn.Module):
    """2x spatial (and optionally 2x temporal) downsample: conv then space-to-channel, plus a
    parameter-free shortcut that averages groups of the space-to-channel input."""

    def __init__(self, in_channels: int, out_channels: int, add_temporal_downsample: bool):
        super().__init__()
        factor = 8 if add_temporal_downsample else 4
        if out_channels % factor != 0:
            raise ValueError(f"out_channels={out_channels} must be divisible by {factor}")
        self.conv = Conv3d(in_channels, out_channels // factor, kernel_size=3, padding=1)
        self.r1 = 2 if add_temporal_downsample else 1
        self.group_size = factor * in_channels // out_channels

    def forward(self, x: Tensor) -> Tensor:
        h = _space_time_to_channels(self.conv(x), self.r1)
        shortcut = _space_time_to_channels(x, self.r1)
        b, c, f, hh, ww = shortcut.shape
        shortcut = shortcut.view(b, h.shape[1], self.group_size, f, hh, ww).mean(dim=2)
        return h + shortcut


class UpsampleDCAE(nn.Module):
    """2x spatial (and optionally 2x temporal) upsample: conv then channel-to-space, plus a
    parameter-free shortcut that repeats channels before the same rearrangement."""

    def __init__(self, in_channels: int, out_channels: int, add_temporal_upsample: bool):
        super().__init__()
        factor = 8 if add_temporal_upsample else 4
        self.conv = Conv3d(in_channels, out_channels * factor, kernel_size=3, padding=1)
        self.r1 = 2 if add_temporal_upsample else 1
        self.repeats = factor * out_channels // in_channels

    def forward(self, x: Tensor) -> Tensor:
        h = _channels_to_space_time(self.conv(x), self.r1)
        shortcut = _channels_to_space_time(x.repeat_interleave(self.repeats, dim=1), self.r1)
        return h + shortcut


class Encoder(nn.Module):
    def __init__(
        self,
        in_channels: int,
        z_channels: int,
        block_out_channels: tuple[int, ...],
        num_res_blocks: int,
        ffactor_spatial: int,
        ffactor_temporal: int,
        norm_num_groups: int,
    ):
        super().__init__()
        self.z_channels = z_channels
        self.conv_in = Conv3d(in_channels, block_out_channels[0], kernel_size=3, padding=1)

        self.down = nn.ModuleList()
        block_in = block_out_channels[0]
        n_spatial = int(math.log2(ffactor_spatial))
        first_temporal = int(math.log2(ffactor_spatial // ffactor_temporal))
        for i_level, block_out in enumerate(block_out_channels):
            down = nn.Module()
            down.block = nn.ModuleList()
            for _ in range(num_res_blocks):
                down.block.append(ResnetBlock(block_in, block_out, norm_num_groups))
                block_in = block_out
            if i_level < n_spatial:
                if i_level == len(block_out_channels) - 1:
                    raise ValueError("need more blocks than log2(downsample_factor)")
                # temporal folding happens in the last log2(ffactor_temporal) downsamplers
                temporal = i_level >= first_temporal
                block_out = block_out_channels[i_level + 1]
                down.downsample = DownsampleDCAE(block_in, block_out, temporal)
                block_in = block_out
            self.down.append(down)

        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, norm_num_groups)
        self.mid.attn_1 = AttnBlock(block_in, norm_num_groups)
        self.mid.block_2 = ResnetBlock(block_in, block_in, norm_num_groups)

        self.norm_out = _group_norm(norm_num_groups, block_in)
        self.conv_out = Conv3d(block_in, 2 * z_channels, kernel_size=3, padding=1)

    def _out_shortcut(self, h: Tensor) -> Tensor:
        """Parameter-free residual around the output head: average channel groups down to the
        2*z moments (official). Toy channel plans narrower than 2*z, which the official
        constructor rejects, repeat channels instead so tiny test models stay buildable."""
        b, c, f, hh, ww = h.shape
        out = 2 * self.z_channels
        if c % out == 0:
            return h.view(b, out, c // out, f, hh, ww).mean(dim=2)
        if out % c == 0:
            return h.repeat_interleave(out // c, dim=1)
        raise ValueError(f"encoder width {c} and 2*latent_channels={out} must divide one another")

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for down in self.down:
            for block in down.block:
                h = block(h)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        shortcut = self._out_shortcut(h)
        h = self.conv_out(self.norm_out.conv_input(h))
        return h + shortcut


class Decoder(nn.Module):
    def __init__(
        self,
        z_channels: int,
        out_channels: int,
        block_out_channels: tuple[int, ...],
        num_res_blocks: int,
        ffactor_spatial: int,
        ffactor_temporal: int,
        norm_num_groups: int,
    ):
        super().__init__()
        if block_out_channels[0] % z_channels != 0:
            raise ValueError(f"decoder width {block_out_channels[0]} must be a multiple of z={z_channels}")
        block_in = block_out_channels[0]
        self.repeats = block_in // z_channels
        self.conv_in = Conv3d(z_channels, block_in, kernel_size=3, padding=1)

        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in, norm_num_groups)
        self.mid.attn_1 = AttnBlock(block_in, norm_num_groups)
        self.mid.block_2 = ResnetBlock(block_in, block_in, norm_num_groups)

        self.up = nn.ModuleList()
        n_spatial = int(math.log2(ffactor_spatial))
        n_temporal = int(math.log2(ffactor_temporal))
        for i_level, block_out in enumerate(block_out_channels):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, block_out, norm_num_groups))
                block_in = block_out
            if i_level < n_spatial or i_level < n_temporal:
                if i_level == len(block_out_channels) - 1:
                    raise ValueError("need more blocks than log2(downsample_factor)")
                # temporal unfolding happens in the first log2(ffactor_temporal) upsamplers
                block_out = block_out_channels[i_level + 1]
                up.upsample = UpsampleDCAE(block_in, block_out, i_level < n_temporal)
                block_in = block_out
            self.up.append(up)

        self.norm_out = _group_norm(norm_num_groups, block_in)
        self.conv_out = Conv3d(block_in, out_channels, kernel_size=3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z) + z.repeat_interleave(self.repeats, dim=1)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in self.up:
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(self.norm_out.conv_input(h))


class AutoencoderKLConv3D(nn.Module):
    """Image-facing wrapper: `encode` gives scaled latents, `decode` takes them back to pixels."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.latent_channels = cfg.latent_channels
        self.autocast_dtype: torch.dtype | None = torch.float16  # set from config.vae_autocast_dtype
        self.ffactor_spatial = cfg.ffactor_spatial
        self.ffactor_temporal = cfg.ffactor_temporal
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(cfg.shift_factor or 0.0)
        blocks = tuple(cfg.block_out_channels)
        common = dict(
            block_out_channels=blocks,
            num_res_blocks=cfg.layers_per_block,
            ffactor_spatial=cfg.ffactor_spatial,
            ffactor_temporal=self.ffactor_temporal,
            norm_num_groups=NORM_GROUPS,
        )
        self.encoder = Encoder(in_channels=cfg.in_channels, z_channels=cfg.latent_channels, **common)
        self.decoder = Decoder(
            z_channels=cfg.latent_channels,
            out_channels=cfg.out_channels,
            **{**common, "block_out_channels": tuple(reversed(blocks))},
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    def _check_spatial(self, h: int, w: int, factor: int) -> None:
        if h % factor or w % factor:
            raise ValueError(f"spatial size {h}x{w} must be a multiple of {factor}")

    @torch.no_grad()
    def encode(self, x: Tensor, *, generator: torch.Generator | None = None, sample_posterior: bool = True) -> Tensor:
        """[B, C, H, W] in [-1, 1] -> scaled latents [B, latent_channels, H/16, W/16].

        As the official `vae_encode`: a draw from the posterior, `latent_dist.sample(generator)`
        (diffusers' `randn_tensor` in the posterior's dtype, on the generator's device), then
        (z - shift) * scale. `sample_posterior=False` takes the mean instead."""
        self._check_spatial(x.shape[-2], x.shape[-1], self.ffactor_spatial)
        x = x.to(self.dtype)
        # an image is a clip of ffactor_temporal identical frames (official `encode`)
        x = x.unsqueeze(2).expand(-1, -1, self.ffactor_temporal, -1, -1)
        with self.autocast(x.device):
            moments = self.encoder(x)  # [B, 2z, 1, h, w]
            mean, logvar = moments.chunk(2, dim=1)
            latents = mean
            if sample_posterior:
                from diffusers.utils.torch_utils import randn_tensor

                std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
                latents = mean + std * randn_tensor(mean.shape, generator=generator, device=moments.device,
                                                    dtype=moments.dtype)
            latents = (latents - self.shift_factor) * self.scaling_factor
        return latents[:, :, 0]

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Scaled latents [B, latent_channels, h, w] -> pixels [B, C, 16h, 16w], roughly [-1, 1]."""
        z = z / self.scaling_factor + self.shift_factor
        with self.autocast(z.device):
            frames = self.decoder(z.to(self.dtype).unsqueeze(2))  # [B, C, ffactor_temporal, H, W]
        return frames[:, :, -1]

    def autocast(self, device: torch.device):
        """The official pipeline runs the VAE in float32 weights under float16 CUDA autocast
        (`vae_autocast_dtype`); on the CPU nothing changes."""
        import contextlib

        if device.type != "cuda" or self.autocast_dtype in (None, torch.float32):
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x))


def build_vae(cfg: VAEConfig) -> AutoencoderKLConv3D:
    """The official `vae` module from config, randomly initialised (load weights separately)."""
    return AutoencoderKLConv3D(cfg)
