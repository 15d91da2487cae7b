"""Regional torch.compile of the decoder layers for DiT denoising steps and the AR's static decode
step (kernel setting `compile=on`; `auto` on CUDA bf16).

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

A compile or kernel failure on some shape runs that shape's layers plainly (`kernels.run_fast`);
under tensor parallelism the compiled parts hold the all-reduces, so all ranks agree on the path.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from .. import kernels
from .attention import allow_recompiles
from .compiled import COMPILED_CALLS

# graphs a compiled part may keep (one per bucket shape and batch: ~33 ratio buckets x CFG batch 1
# or 2, and the prefill shapes of the step cache); dynamo's default is 8, and past the limit it runs
# the function eagerly without a word
RECOMPILE_LIMIT = 256
# torch.compile backend: inductor on the GPU; tests on the CPU may use "aot_eager" (set here, or for
# spawned ranks through ARDIT_COMPILE_BACKEND, read at import)
BACKEND = os.environ.get("ARDIT_COMPILE_BACKEND", "inductor")
# True: one graph dynamic in the token count serves every bucket (one compile per process instead
# of one per image size); False: a static graph per bucket shape
DYNAMIC_TOKENS = False

_regions: dict[str, tuple[Callable, Callable]] = {}


def regions(layer_type: type, kind: str = "step") -> tuple[Callable, Callable]:
    """The compiled (attention_inputs, finish) pair of the decoder layer class (transformer's
    DecoderLayer: taken from the layer, so the kernels never import the model) for `kind`, made on
    first use:
    - "step": a DiT step, static in its shape (a graph per image bucket);
    - "decode": the AR decode step, dynamic in the batch (its rows change as rows come and go:
      one graph serves them all, where static graphs would compile once per batch bucket);
    - "prefill": a prompt chunk (the AR's prefill, the DiT's reuse prefix), dynamic in the token
      count (every prompt has its own length: one graph serves them all)."""
    if kind not in _regions:
        allow_recompiles(RECOMPILE_LIMIT)
        static = kind == "step" and not DYNAMIC_TOKENS
        dynamic = False if static else None  # None: the dims marked in layer_step only
        _regions[kind] = (torch.compile(layer_type.attention_inputs, backend=BACKEND, dynamic=dynamic),
                          torch.compile(layer_type.finish, backend=BACKEND, dynamic=dynamic))
    return _regions[kind]


def reset() -> None:
    """Forget the compiled graphs (tests switch backends)."""
    _regions.clear()
    torch._dynamo.reset()


def layer_step(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask,
               cache, index: int, prefill: bool = False) -> torch.Tensor:
    """DecoderLayer.forward with its two compiled parts (cache: the model's KVCache or None).
    `prefill`: x is a prompt chunk (any token count)."""
    decode = x.shape[1] == 1  # an AR decode step (or a one-token chunk): one token per row, dynamic in the rows
    kind = "decode" if decode else "prefill" if prefill else "step"
    attention_inputs, finish = regions(type(layer), kind)
    dynamic = kind != "step" or DYNAMIC_TOKENS
    if dynamic:
        for t in (x, cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, 0 if decode else 1)
    with COMPILED_CALLS:
        q, k, v = attention_inputs(layer, x, cos, sin)
    out = layer.cached_attention(q, k, v, mask, cache, index)
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(out, 0 if decode else 2)
    with COMPILED_CALLS:
        return finish(layer, x, out)


def run_layers(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache,
               indices, prefill: bool = False) -> torch.Tensor:
    """`model.forward_layers(..., compiled=True)`: the layers `indices` through the compiled parts,
    or plainly for a shape whose compiled parts failed (the cache writes of a failed try are
    written again by the plain layers: same slots). `prefill`: x is a prompt chunk; one graph
    serves every token count, so a failure sends every chunk of that batch the plain way."""
    layers = model.model.layers
    x = x.contiguous()  # as every later layer's input: one graph serves the first layer too

    def compiled() -> torch.Tensor:
        h = x
        for i in indices:
            h = layer_step(layers[i], h, cos, sin, mask, cache, i, prefill)
        return h

    def plain() -> torch.Tensor:
        h = x
        for i in indices:
            h = layers[i](h, cos, sin, mask, cache, i)
        return h

    shape = ("prefill", x.shape[0], x.shape[1] == 1) if prefill else (tuple(x.shape), tuple(cos.shape))
    key = (shape, x.dtype, type(mask).__name__, tuple(indices))
    return kernels.run_fast("compiled_layers", key, compiled, plain, getattr(model, "parallel", None))
