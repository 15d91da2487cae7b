"""Row-wise scaled FP8 grouped GEMM for few rows per expert (the AR decode step's routed experts).

`torch._scaled_grouped_mm` (CUTLASS) tiles each expert's rows by 128 or more. At decode an expert
gets a handful of rows (42 rows x top-8 over 64 experts: ~5), so most of each tile is padding and
the padded tensor-core work competes with reading the weights: on one H200 the two expert GEMMs of
a decode layer took 0.87 ms where their weights take 0.57 ms to read (benchmarks/decode_profile.py).

This kernel tiles rows by 16 (the tensor cores' smallest M) and an expert's output channels by
BLOCK_N: grid (expert, channel block). A program reads its expert's weight block once per 16 of its
rows (an expert without rows reads nothing), accumulates in fp32 and applies the row scale of the
activations and the channel scale of the weights, as `_scaled_grouped_mm` with rowwise scales:

    out[i, n] = (sum_k a[i, k] * b[e, n, k]) * scale_a[i] * scale_b[e, n]   for rows i of expert e

Used where the rows are few (`FEW_ROWS`); the CUTLASS GEMM stays for prefill and DiT shapes.
"""

from __future__ import annotations

import torch

try:  # defined only where Triton is installed (CUDA builds of torch ship it)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FEW_ROWS = 1024  # (token, expert) pairs up to which this kernel runs: 128 tokens at top-8
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Triton on a CUDA GPU with FP8 tensor cores (SM89+), few rows, K a multiple of BLOCK_K."""
    return (triton is not None and a.is_cuda and a.dtype == b.dtype == torch.float8_e4m3fn
            and a.shape[0] <= FEW_ROWS and a.shape[1] % BLOCK_K == 0
            and torch.cuda.get_device_capability(a.device) >= (8, 9))


def grouped_mm_few_rows(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        offs: torch.Tensor, block_n: int = BLOCK_N, num_stages: int = 4,
                        num_warps: int = 4) -> torch.Tensor:
    """a [M, K] FP8 rows in expert order, b [E, N, K] FP8, scale_a [M] / scale_b [E, N] float32,
    offs [E] int32 end offset of each expert's rows -> [M, N] bfloat16."""
    m, k = a.shape
    experts, n, _ = b.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    _kernel[(experts, triton.cdiv(n, block_n))](
        a, b, scale_a, scale_b, offs, out, n, a.stride(0), b.stride(0), b.stride(1), out.stride(0), K=k,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_stages=num_stages, num_warps=num_warps)
    return out


if triton is not None:
    @triton.jit
    def _kernel(A, B, ScaleA, ScaleB, Offs, Out, N, sa_m, sb_e, sb_n, so_m, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        expert = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        end = tl.load(Offs + expert)
        start = tl.load(Offs + expert - 1, mask=expert > 0, other=0)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < N
        scale_b = tl.load(ScaleB + expert * N + cols, mask=col_ok, other=0.0)
        b_rows = B + expert * sb_e + cols[:, None] * sb_n
        m0 = start
        while m0 < end:  # an expert without rows reads nothing
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(A + rows[:, None] * sa_m + k0 + kk[None, :], mask=row_ok[:, None], other=0.0)
                b = tl.load(b_rows + k0 + kk[None, :], mask=col_ok[:, None], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc)
            scale_a = tl.load(ScaleA + rows, mask=row_ok, other=0.0)
            acc = acc * scale_a[:, None] * scale_b[None, :]
            tl.store(Out + rows[:, None] * so_m + cols[None, :], acc.to(tl.bfloat16),
                     mask=row_ok[:, None] & col_ok[None, :])
            m0 += BLOCK_M
