"""Regional torch.compile of the decoder layers for DiT denoising steps (kernel setting `compile=on`).

A layer runs as  [attention_inputs] -> KV-cache write + attention -> [finish]  where the two
bracketed parts (norms, QKV projection, RoPE, QK-norm; output projection, residuals, MoE) are
compiled and the middle stays eager:

- the compiled parts see only x's shape [B, T, H], fixed per image bucket (T = the step's special
  tokens + the image tokens), never the prefix length (it differs between prompts) or the layer
  index, both plain Python ints that dynamo would specialize on and recompile for;
- the parts are compiled as functions of the layer module, so one graph serves all 32 layers
  (their parameters are graph inputs), and compile time is that of one layer;
- static shapes (dynamic=False): each bucket gets its own graph, reused by every step and every
  request of that bucket.

Attention itself is SDPA's flash kernel over the cached prefix (the step's image rows are unmasked,
see transformer.HeadMask), which compilation would not speed up.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..transformer import DecoderLayer, KVCache, attend
from .attention import allow_recompiles

# graphs a compiled part may keep (one per bucket shape and batch); dynamo's default is 8
RECOMPILE_LIMIT = 64
# torch.compile backend: inductor on the GPU; tests on the CPU may use "aot_eager"
BACKEND = "inductor"

_regions: tuple[Callable, Callable] | None = None


def regions() -> tuple[Callable, Callable]:
    """The compiled (attention_inputs, finish) pair, made on first use."""
    global _regions
    if _regions is None:
        allow_recompiles(RECOMPILE_LIMIT)
        _regions = (torch.compile(DecoderLayer.attention_inputs, backend=BACKEND, dynamic=False),
                    torch.compile(DecoderLayer.finish, backend=BACKEND, dynamic=False))
    return _regions


def reset() -> None:
    """Forget the compiled graphs (tests switch backends)."""
    global _regions
    _regions = None
    torch._dynamo.reset()


def layer_step(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask,
               cache: KVCache | None, index: int) -> torch.Tensor:
    """DecoderLayer.forward with its two compiled parts."""
    attention_inputs, finish = regions()
    q, k, v = attention_inputs(layer, x, cos, sin)
    if cache is not None:
        k, v = cache.update(index, k, v)
    return finish(layer, x, attend(q, k, v, mask))
