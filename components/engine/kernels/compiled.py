"""Small element-wise / gather-reduce functions run through `torch.compile`, one fused kernel each.

Shared by the fused MoE dispatch (kernels/moe.py) and the FP8 path (quant.py). A function is
compiled on first use with CUDA inputs; elsewhere (CPU, or inside an outer torch.compile region)
it runs eagerly, computing the same formula. If compiling fails, the failure is recorded in
`compile_failures` (and counted in `kernels.fallbacks()`), warned about once, and the function runs
eagerly from then on; out of memory and other errors that are not the compiler's are raised.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

# Calls of compiled functions (here, the layer regions of compiled_layers.py, flex attention), one
# thread at a time. A call that compiles sets torch.fx's process-wide tracing flag while it traces,
# and a compiled call in another thread meanwhile fails ("Detected that you are using FX to
# symbolically trace a dynamo-optimized function"): an overlapped job's AR and DiT threads hit it,
# and it sent shapes to their plain paths for good (10 fallbacks, half-speed DiT steps). A call only
# launches GPU work, so holding this for it keeps the GPU work of the two threads overlapping.
COMPILED_CALLS = threading.RLock()  # the error, should it come anyway: kernels.is_nested_trace


_compiled_fns: dict[Callable, Callable] = {}
compile_failures: dict[str, str] = {}  # function name -> error; those run eagerly (same numbers, slower)


def _compiled(fn: Callable) -> Callable:
    if fn not in _compiled_fns:
        _compiled_fns[fn] = torch.compile(fn, fullgraph=True)
    return _compiled_fns[fn]


def call_compiled(fn: Callable, *args: torch.Tensor, dynamic: int = 1):
    """fn(*args) through its compiled version. The first `dynamic` arguments have a token count as
    dim 0 that changes with every batch: one graph serves them all (sizes 0 and 1 specialise)."""
    if fn.__name__ in compile_failures or torch.compiler.is_compiling() or not args[0].is_cuda:
        return fn(*args)
    for t in args[:dynamic]:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        with COMPILED_CALLS:
            return _compiled(fn)(*args)
    except Exception as e:  # noqa: BLE001 - a compiler failure: the eager function computes the same
        from . import is_kernel_failure, is_nested_trace, record_fallback

        if is_nested_trace(e):
            return fn(*args)  # this call only: the function is not broken
        if not is_kernel_failure(e):
            raise
        compile_failures[fn.__name__] = f"{type(e).__name__}: {e}"[:500]
        record_fallback("compiled_fn", fn.__name__, e)  # counted with the other kernel fallbacks
        warnings.warn(f"torch.compile of {fn.__name__} failed, running it eagerly: {e}", stacklevel=2)
        return fn(*args)
