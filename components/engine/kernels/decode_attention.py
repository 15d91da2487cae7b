"""Split-KV attention for the static AR decode step (`decode_attention=split`; `auto` on CUDA bf16).

The static step (kernels/decode.py) attends over a fixed span of cache slots so that its CUDA
graphs keep their shapes. SDPA then reads the whole span of every row: under continuous batching
the span is the longest row's, so a 1k-token T2I row next to a 7k-token edit row reads 7k slots,
and a free slot of the pool reads them too. On the full model (one H200, 42 slots, span 7 168,
mean K/V 2.9k) that attention took 0.34 ms a layer, 3.7x the bytes the rows hold.

This kernel reads each row only up to its own length: `kv_len[b]` (the row's write slot + 1) is a
device tensor, so the graph's shapes stay static while the work follows the rows.

    split     grid (row x KV head, span / SPLIT): each program takes one KV head's `groups` query
              heads (padded to 16 rows for the tensor cores) over one slice of slots below kv_len,
              with the validity mask, an online softmax in fp32, P rounded to the K/V dtype for
              P @ V (as flash attention); it stores its slice's normalised output and log-sum-exp.
              Slices at or past kv_len store an empty result at once.
    merge     grid (row x KV head): the slices weighted by exp(lse - max lse), in slice order.

No atomics: a row's result depends only on its own inputs and the span, so a replay equals the
eager step bitwise, and a row's numbers do not depend on its neighbours. Slots at or past `kv_len`
are never read: the caller masks them anyway (a decode query sees no later slot).
"""

from __future__ import annotations

import torch

try:  # kernels are defined only where Triton is installed (CUDA builds of torch ship it)
    import triton
    import triton.language as tl
except ImportError:  # the CPU: `supported` is False, nothing below is defined
    triton = None

SPLIT = 512  # slots per program: enough programs for a small batch, few partial results to merge
BLOCK_N = 64  # slots per inner step
BLOCK_G = 16  # query rows per program (the tensor cores' smallest M); a KV group's heads, padded


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """CUDA bf16/fp16 with Triton, one query token, head dim a power of two >= 16, equal K/V heads
    dividing the query heads into groups of at most BLOCK_G."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype):
        return False
    if triton is None:
        return False
    d = q.shape[-1]
    heads, kv_heads = q.shape[1], k.shape[1]
    return (q.shape[2] == 1 and d >= 16 and d & (d - 1) == 0 and heads % kv_heads == 0
            and heads // kv_heads <= BLOCK_G and k.stride(-1) == 1)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                       kv_len: torch.Tensor) -> torch.Tensor:
    """SDPA(q, k, v, attn_mask=keep) with query head h on KV head h // groups, reading each row's
    slots below kv_len only. q [B, H, 1, D]; k, v [B, KVH, S, D] (slot stride free, D contiguous);
    keep [B, 1, 1, S] bool; kv_len [B] int64. Returns [B, H, 1, D] in q's dtype."""
    b, heads, _, d = q.shape
    kv_heads, span = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    splits = -(-span // SPLIT)
    qg = q.reshape(b, kv_heads, groups, d)  # contiguous: head h -> (h // groups, h % groups)
    keep2 = keep.reshape(b, span).view(torch.uint8)
    part = torch.empty(b * kv_heads, splits, BLOCK_G, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b * kv_heads, splits, BLOCK_G, dtype=torch.float32, device=q.device)
    out = torch.empty(b, kv_heads, groups, d, dtype=q.dtype, device=q.device)
    _split_kernel[(b * kv_heads, splits)](
        qg, k, v, keep2, kv_len, part, lse,
        qg.stride(0), qg.stride(1), qg.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), keep2.stride(0), d ** -0.5,
        KVH=kv_heads, G=groups, D=d, BLOCK_G=BLOCK_G, BLOCK_N=BLOCK_N, SPLIT=SPLIT, NSPLITS=splits,
        num_warps=4, num_stages=3)
    _merge_kernel[(b * kv_heads,)](
        part, lse, out, out.stride(0), out.stride(1), out.stride(2),
        KVH=kv_heads, G=groups, D=d, BLOCK_G=BLOCK_G, NSPLITS=splits,
        NSPLITS_P2=1 << max(splits - 1, 0).bit_length(), num_warps=4)
    return out.reshape(b, heads, 1, d)



# -- the kernels -----------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Keep, KvLen, Part, Lse,
              sq_b, sq_h, sq_g, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, skeep_b, scale,
              KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
              BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NSPLITS: tl.constexpr):
        pid = tl.program_id(0)  # row * KVH + kv head
        part = tl.program_id(1)
        row = pid // KVH
        head = pid % KVH
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        start = part * SPLIT
        end = tl.minimum(start + SPLIT, tl.load(KvLen + row))
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        if start < end:
            q = tl.load(Q + row * sq_b + head * sq_h + g[:, None] * sq_g + d[None, :],
                        mask=g[:, None] < G, other=0.0)
            k_base = K + row * sk_b + head * sk_h
            v_base = V + row * sv_b + head * sv_h
            for i in range(SPLIT // BLOCK_N):  # a static trip count; blocks past the row's end are skipped
                n0 = start + i * BLOCK_N
                if n0 < end:
                    slots = n0 + tl.arange(0, BLOCK_N)
                    inside = slots < end
                    keep = tl.load(Keep + row * skeep_b + slots, mask=inside, other=0) != 0
                    k = tl.load(k_base + slots[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
                    s = tl.dot(q, tl.trans(k)) * scale
                    s = tl.where(keep[None, :], s, float("-inf"))
                    m_new = tl.maximum(m, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: no NaN
                    p = tl.exp(s - m_safe[:, None])
                    alpha = tl.exp(m - m_safe)
                    total = total * alpha + tl.sum(p, 1)
                    v = tl.load(v_base + slots[:, None] * sv_s + d[None, :], mask=inside[:, None], other=0.0)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    m = m_new
        has = total > 0
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        acc = acc / tl.where(has, total, 1.0)[:, None]
        at = pid * NSPLITS + part
        tl.store(Part + (at * BLOCK_G + g[:, None]) * D + d[None, :], acc)
        tl.store(Lse + at * BLOCK_G + g, lse)

    @triton.jit
    def _merge_kernel(Part, Lse, Out, so_b, so_h, so_g,
              KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
              NSPLITS: tl.constexpr, NSPLITS_P2: tl.constexpr):
        pid = tl.program_id(0)
        row = pid // KVH
        head = pid % KVH
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        s = tl.arange(0, NSPLITS_P2)
        lse = tl.load(Lse + (pid * NSPLITS + s[:, None]) * BLOCK_G + g[None, :],
                      mask=s[:, None] < NSPLITS, other=float("-inf"))  # [splits, BLOCK_G]
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.exp(lse - top[None, :])
        norm = tl.sum(weight, 0)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for i in range(NSPLITS):  # slice order: a fixed summation order
            w = tl.sum(tl.where(s[:, None] == i, weight, 0.0), 0)
            acc += w[:, None] * tl.load(Part + ((pid * NSPLITS + i) * BLOCK_G + g[:, None]) * D + d[None, :])
        acc = acc / tl.where(norm > 0, norm, 1.0)[:, None]
        tl.store(Out + row * so_b + head * so_h + g[:, None] * so_g + d[None, :],
                 acc.to(Out.dtype.element_ty), mask=g[:, None] < G)
