"""The Triton kernels of the AR decode step (kernels/decode_attention.py, kernels/fp8_grouped.py):
their selection and fallbacks on the CPU, and their numbers through Triton's interpreter where
Triton is installed (a CUDA build of torch ships it; the CPU CI has none and skips those two).
On the GPU, benchmarks/decode_attention.py and benchmarks/fp8_grouped.py compare them with SDPA,
CUTLASS and fp32 references at full size."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from components.engine import kernels
from components.engine.kernels import decode_attention, fp8_grouped
from components.engine.kernels.decode import DecodeMask

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def test_plain_and_fast_choose_the_kernels():
    plain, fast = kernels.parse("plain"), kernels.parse("fast")
    assert (plain.decode_attention, plain.expert_gemm) == ("sdpa", "cutlass")
    assert (fast.decode_attention, fast.expert_gemm) == ("split", "auto")
    with pytest.raises(ValueError, match="expert_gemm"):
        kernels.parse("expert_gemm=triton")


def test_cpu_tensors_take_sdpa_and_cutlass_paths():
    q, k = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 10, 16)
    assert not decode_attention.supported(q, k)
    assert not fp8_grouped.supported(torch.zeros(4, 128).to(torch.float8_e4m3fn),
                                     torch.zeros(2, 8, 128).to(torch.float8_e4m3fn))
    keep = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., 7:] = False
    mask = DecodeMask(keep, torch.tensor([7, 10]))
    previous = kernels.configure(decode_attention="split")
    try:
        assert torch.equal(mask.attend(q, k, k), mask.sdpa(q, k, k))
    finally:
        kernels.configure(previous)


def test_a_fallen_back_shape_runs_plain_even_while_a_graph_is_captured(monkeypatch):
    """A capture's warm-up may fall back; the capture that follows must then record the plain path,
    not the fast one that failed (which would fail the capture and the step's graphs with it)."""
    kernels.reset_fallbacks()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def fast():
        raise RuntimeError("no kernel for this shape")

    try:
        kernels.record_fallback("decode_attention", ("shape",), RuntimeError("no kernel for this shape"))
        assert kernels.run_fast("decode_attention", ("shape",), fast, lambda: "plain") == "plain"
        with pytest.raises(RuntimeError, match="no kernel for this shape"):  # another shape still tries its fast path while capturing
            kernels.run_fast("decode_attention", ("other",), fast, lambda: "plain")
    finally:
        kernels.reset_fallbacks()


def _interpret(script: str) -> str:
    """Run `script` with Triton's interpreter (on the CPU, numpy), in a fresh process: the interpreter
    is chosen when Triton is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_triton
def test_split_kv_attention_is_masked_sdpa():
    """Rows of different lengths (one with left padding and a hole), query heads in groups of 4,
    several slices per row: the interpreter's result is SDPA's in fp32 (the interpreter has no bf16)."""
    out = _interpret("""
        import torch, torch.nn.functional as F
        from components.engine.kernels import decode_attention as da
        torch.manual_seed(0)
        b, heads, kv_heads, d, capacity, span = 3, 8, 2, 32, 1400, 1100
        q = torch.randn(b, heads, 1, d)
        k_cache, v_cache = torch.randn(b, kv_heads, capacity, d), torch.randn(b, kv_heads, capacity, d)
        k, v = k_cache[:, :, :span], v_cache[:, :, :span]
        kv_len = torch.tensor([1100, 300, 1])
        keep = torch.arange(span)[None] < kv_len[:, None]
        keep[0, :10] = False
        keep[1, 200:250] = False
        keep = keep.view(b, 1, 1, span)
        ref = F.scaled_dot_product_attention(q.reshape(b, kv_heads, 4, d), k, v, attn_mask=keep).reshape(b, heads, 1, d)
        out = da.split_kv_attention(q, k, v, keep, kv_len)
        print((out - ref).abs().max().item())
    """)
    assert float(out.split()[-1]) <= 1e-5


@needs_triton
def test_few_rows_grouped_gemm_is_the_scaled_product():
    """Experts with 3, 0, 20 (two row tiles), 1 and 7 rows; rowwise and channel scales applied."""
    out = _interpret("""
        import torch
        from components.engine.kernels import fp8_grouped as fg
        torch.manual_seed(0)
        experts, n, k = 5, 96, 256
        counts = [3, 0, 20, 1, 7]
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        a, b = torch.randn(sum(counts), k), torch.randn(experts, n, k)
        scale_a, scale_b = torch.rand(sum(counts)) + 0.5, torch.rand(experts, n) + 0.5
        out = fg.grouped_mm_few_rows(a, b, scale_a, scale_b, offs, block_n=32).float()
        ref, start = [], 0
        for e, c in enumerate(counts):
            ref.append((a[start:start + c] @ b[e].T) * scale_a[start:start + c, None] * scale_b[e][None, :])
            start += c
        ref = torch.cat(ref)
        print(((out - ref).abs().max() / ref.abs().max()).item())
    """)
    assert float(out.split()[-1]) <= 8e-3  # the output is rounded to bf16
