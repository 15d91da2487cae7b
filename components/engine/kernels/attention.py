"""Flex attention with block masks for the engine's mixed masks (kernel setting `attention=flex`).

The masks of prefills and DiT first steps are causal over cache slots, bidirectional inside each
image block, and hide padding keys (`transformer.SlotMask`). SDPA takes them as a dense bool
[B, 1, T, S], which sends it to its slow masked kernel; flex attention takes a BlockMask instead:
tiles wholly visible run without a mask, tiles wholly hidden are skipped, and only the tiles on a
boundary evaluate the rule per element.

On CUDA flex attention runs compiled (one fused Triton kernel; a second sequence length makes the
compiled kernel dynamic in the lengths instead of compiling per length). On the CPU it runs eagerly,
which materializes the scores: slow, but exact, and enough for tests at tiny sizes.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Tile of the block mask (queries x keys). The kernel's BLOCK_M / BLOCK_N must divide it.
BLOCK_SIZE = 128
# Triton options for the compiled kernel (BLOCK_M, BLOCK_N, num_warps, num_stages, ...); None lets
# flex attention choose. benchmarks/attention_kernels.py compares choices.
KERNEL_OPTIONS: dict | None = None
# A SlotMask whose rule is plain causal (no image block, no padding, T == S: a T2I prefix) takes
# causal SDPA (flash) instead of flex. On the tiny model in bf16 this made T2I reuse vs recompute
# 39.8 dB instead of bitwise (the reuse path's tail prefill, T < S, still runs flex): see
# docs/benchmarks.md; set False to send every SlotMask to flex.
CAUSAL_SDPA = True
# Copy q, k, v to contiguous [B, H, T, D] before the compiled kernel (the layer's are transposed
# views of [B, T, H, D], the cache's K/V slices of a longer buffer); one layout also means one graph.
CONTIGUOUS = True

# `attention=auto` takes flex only from this many (query, key) pairs per call (B * T * S). Below it
# SDPA with the dense bool mask measured faster: the DiT's reuse tail prefills (a few to ~1k queries
# over a few thousand keys, where flex's 128-query tiles are mostly padding) and one-row prefills
# whose mask is nearly all one image block (few tiles to skip). Flex wins on the DiT's CFG prefix
# and larger calls. Measurements: docs/benchmarks.md ("Fast kernels at tensor-parallel head counts",
# "Flex attention with block masks"). `attention=flex` takes flex at every size.
FLEX_MIN_PAIRS = 64 * 2**20

_compiled: Callable | None = None


def worth_flex(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this call is large enough for flex under `attention=auto` (see FLEX_MIN_PAIRS)."""
    return q.shape[0] * q.shape[2] * k.shape[2] >= FLEX_MIN_PAIRS


def shape_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """The fallback key of a flex call: heads, dtype and the lengths rounded up to a power of two
    (one compiled kernel serves many lengths, so a failure at one length stands for its neighbours)."""
    b, heads, t, d = q.shape
    return (b, heads, k.shape[1], d, q.dtype, 1 << (t - 1).bit_length(), 1 << (k.shape[2] - 1).bit_length())


def allow_recompiles(limit: int = 64) -> None:
    """Let a compiled function keep up to `limit` graphs (dynamo's default is 8: past it, dynamo
    silently falls back to eager, which for flex attention would materialize the whole score matrix)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
    for total in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):  # over all functions
        if hasattr(config, total):
            setattr(config, total, max(getattr(config, total), 4 * limit))
            break


def block_mask(dense: torch.Tensor, mask_mod: Callable, block: int | None = None) -> BlockMask:
    """The BlockMask of a dense bool mask [B, 1, T, S] (broadcast over heads, so it serves every
    tensor-parallel rank) whose elements `mask_mod` gives to the kernel.

    As create_block_mask, but from a dense mask made by broadcasting (a few passes over B*T*S
    bytes) instead of vmap over mask_mod, which is slow at DiT sequence lengths: tiles
    wholly visible are "full" (no mask_mod), tiles with some visible pairs "partial", the rest
    skipped; the ends are padded with hidden pairs, so edge tiles are partial.
    """
    block = block or BLOCK_SIZE
    b, h, t, s = dense.shape
    tq, tk = -(-t // block), -(-s // block)
    padded = F.pad(dense, (0, tk * block - s, 0, tq * block - t))
    tiles = padded.view(b, h, tq, block, tk, block)
    any_visible = tiles.any(dim=5).any(dim=3)
    full = tiles.all(dim=5).all(dim=3)
    partial_num, partial_idx = _ordered(any_visible & ~full)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(t, s))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: how many key tiles are set, and their indices first (BlockMask's layout)."""
    as_int = tiles.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(-1).to(torch.int32).contiguous(), order.to(torch.int32).contiguous()


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """q [B, Hq, T, D] over k, v [B, Hkv, S, D] (grouped-query heads) under a BlockMask, with the
    default 1/sqrt(D) scale, like F.scaled_dot_product_attention."""
    if q.is_cuda:
        global _compiled
        if _compiled is None:
            allow_recompiles()  # tile choices and sequence layouts each take a graph
            _compiled = torch.compile(flex_attention)
        options = {"kernel_options": KERNEL_OPTIONS} if KERNEL_OPTIONS else {}
        if CONTIGUOUS:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # q, k, v are in the model dtype already; the engine's autocast adds nothing to the kernel
        # but is one more state the compiled graph depends on (pytorch#176025: autocast + flex ->
        # NoValidChoicesError, in the backward there)
        from .compiled import COMPILED_CALLS

        with torch.autocast("cuda", enabled=False), COMPILED_CALLS:
            return _compiled(q, k, v, block_mask=mask, enable_gqa=True, **options)
    with warnings.catch_warnings():  # "called without torch.compile": intended off CUDA
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
