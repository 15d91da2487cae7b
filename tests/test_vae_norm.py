"""The VAE's GroupNorm: nn.GroupNorm on the CPU, its compiled CUDA formula checked eagerly here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from components.engine import kernels
from components.engine import vae as vae_module
from components.engine.config import tiny_config
from components.engine.vae import GroupNorm, build_vae, fast_norms, group_norm, group_norm_silu

EPS = 1e-6


def _inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with an offset (a variance formula that cancels badly would show), affine parameters."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=g) * 3 + 5
    return x, torch.randn(c, generator=g), torch.randn(c, generator=g)


def _pair(channels: int, seed: int = 0) -> tuple[GroupNorm, nn.GroupNorm]:
    ref = nn.GroupNorm(32, channels, eps=EPS)
    with torch.no_grad():
        _, ref.weight[:], ref.bias[:] = _inputs((1, channels), seed)
    ours = GroupNorm(32, channels, eps=EPS)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


@pytest.mark.parametrize("shape", [(2, 64, 3, 5, 7), (1, 128, 6, 6)])
def test_cpu_path_is_nn_group_norm_bitwise(shape):
    ours, ref = _pair(shape[1])
    x, _, _ = _inputs(shape, seed=1)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        assert torch.equal(ours.conv_input(x), F.silu(ref(x)))
        assert torch.equal(ours.conv_input(x, silu=False), ref(x))


def test_state_dict_names_unchanged():
    ours, ref = _pair(64)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    fresh = GroupNorm(32, 64, eps=EPS)
    fresh.load_state_dict(ref.state_dict(), strict=True)
    assert torch.equal(fresh.weight, ref.weight) and torch.equal(fresh.bias, ref.bias)
    # every norm of the VAE is the new module, under the official names
    vae = build_vae(tiny_config().vae)
    norms = {name: m for name, m in vae.named_modules() if isinstance(m, nn.GroupNorm)}
    assert norms and all(type(m) is GroupNorm for m in norms.values())
    assert {"encoder.down.0.block.0.norm1", "encoder.mid.attn_1.norm", "decoder.norm_out"} <= set(norms)


@pytest.mark.parametrize("shape", [(2, 64, 3, 5, 7), (1, 128, 16, 16), (2, 32, 10)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
def test_formula_matches_nn_group_norm(shape, in_dtype):
    x, w, b = _inputs(shape)
    x = x.to(in_dtype)
    ref = F.group_norm(x.float(), 32, w, b, EPS)  # what autocast runs: the input cast to float32
    y = group_norm(x, w, b, 32, EPS, torch.float32)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(group_norm_silu(x, w, b, 32, EPS, torch.float32), F.silu(ref), rtol=1e-5, atol=1e-5)


def test_fused_silu_in_conv_dtype_is_one_rounding_of_the_reference():
    """The float16 output is silu(group_norm(x)) in float32 rounded once: what the conv cast
    under autocast makes of the reference, up to a last-bit flip from float32 rounding."""
    x, w, b = _inputs((2, 64, 3, 8, 8))
    x = x.half()
    ref = F.silu(F.group_norm(x.float(), 32, w, b, EPS)).half()
    y = group_norm_silu(x, w, b, 32, EPS, torch.float16)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref)  # float16 tolerances: about one unit in the last place
    assert (y == ref).float().mean() > 0.99
    y = group_norm(x, w, b, 32, EPS, torch.float16)  # the attention block's norm: no SiLU
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, F.group_norm(x.float(), 32, w, b, EPS).half())


def test_fast_path_wiring_matches_plain_vae(monkeypatch):
    """With the compiled path forced on (it runs its formula eagerly on the CPU), the tiny VAE
    encodes and decodes as with nn.GroupNorm: every norm passes its own parameters, and the
    attention block's norm has no SiLU."""
    torch.manual_seed(0)
    vae = build_vae(tiny_config().vae).eval()
    x = torch.rand(2, 3, 64, 48) * 2 - 1
    z_plain = vae.encode(x, sample_posterior=False)
    img_plain = vae.decode(z_plain)

    calls = []

    def counting(fn, *args, **kw):
        calls.append(fn.__name__)
        return fn(*args)

    monkeypatch.setattr(vae_module, "fast_norms", lambda t: True)
    monkeypatch.setattr(vae_module, "call_compiled", counting)
    z_fast = vae.encode(x, sample_posterior=False)
    img_fast = vae.decode(z_plain)
    n_norms = sum(isinstance(m, GroupNorm) for m in vae.modules())
    assert len(calls) == n_norms and calls.count("group_norm") == 2  # the two attention blocks
    torch.testing.assert_close(z_fast, z_plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(img_fast, img_plain, rtol=1e-4, atol=1e-4)


def test_fast_path_switch():
    """Compiled norms on CUDA without autograd, unless the kernel setting compile=off."""
    cuda_like = SimpleNamespace(is_cuda=True)
    previous = kernels.configure(compile="auto")
    try:
        with torch.no_grad():
            assert fast_norms(cuda_like)
            assert not fast_norms(torch.zeros(1))
            kernels.configure("plain")
            assert not fast_norms(cuda_like)
        kernels.configure(compile="on")
        with torch.enable_grad():
            assert not fast_norms(cuda_like)
    finally:
        kernels.configure(previous)
