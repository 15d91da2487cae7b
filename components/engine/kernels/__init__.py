"""Which kernels the engine runs: the plain PyTorch paths (the reference, used on CPU) or the fast
CUDA paths (flex attention with block masks, fused MoE dispatch, CUDA-graph decode, compiled DiT
layers). Every fast path is compared against its plain path in tests or benchmarks.

Settings are process-wide, like `torch.backends` flags: `configure("attention=flex,moe=fused")`,
or the `ARDIT_KERNELS` environment variable in the same form (read at first use). A value of
`auto` picks the fast path for CUDA bfloat16 tensors and the plain one otherwise.

A fast path that fails on some shape (a compiler or kernel error) falls back to the plain path for
that shape (`run_fast`), counted by `fallbacks()`: a slower step, never a failed row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

# name -> allowed values; the first is the default
CHOICES: dict[str, tuple[str, ...]] = {
    "attention": ("auto", "sdpa", "flex"),        # masked prefills / DiT first steps
    "moe": ("auto", "loop", "grouped", "fused"),  # routed-expert dispatch
    "decode_graphs": ("auto", "off", "on"),       # CUDA graphs for AR decode
    "decode_attention": ("auto", "sdpa", "split"),  # AR decode attention (split: each row to its length)
    "expert_gemm": ("auto", "cutlass"),           # FP8 experts with few rows: Triton (auto) or CUTLASS
    "compile": ("auto", "off", "on"),             # torch.compile of the layers (DiT steps, AR decode), VAE norms
    "compile_prefill": ("off", "on"),             # prompt chunks (AR prefill, DiT prefix) compiled too: see prefill_compiled
    "batch_invariant": ("off", "on"),             # a row is bitwise independent of its batch
    "fp8_accum": ("auto", "exact", "fast"),       # FP8 GEMMs' accumulation: see fast_accumulation
    "stage_row_groups": ("auto", "off"),          # AR under pipeline stages: a row group per stage, or one
}


@dataclass(frozen=True)
class KernelSettings:
    attention: str = "auto"
    moe: str = "auto"
    decode_graphs: str = "auto"
    decode_attention: str = "auto"
    expert_gemm: str = "auto"
    compile: str = "auto"
    compile_prefill: str = "off"
    batch_invariant: str = "off"
    fp8_accum: str = "auto"
    stage_row_groups: str = "auto"

    def describe(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


_current: KernelSettings | None = None


def parse(spec: str | None, base: KernelSettings | None = None) -> KernelSettings:
    """'attention=flex,moe=fused' -> KernelSettings; 'plain' turns every fast path off, 'fast' on."""
    out = base or KernelSettings()
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        if item in ("plain", "fast"):
            fast = item == "fast"
            # plain: the engine before the fast paths (grouped GEMMs where they run, else the loop)
            out = replace(out, attention="flex" if fast else "sdpa", moe="fused" if fast else "grouped",
                          decode_graphs="on" if fast else "off", compile="on" if fast else "off",
                          decode_attention="split" if fast else "sdpa",
                          expert_gemm="auto" if fast else "cutlass", stage_row_groups="auto" if fast else "off",
                          fp8_accum="auto" if fast else "exact")
            continue
        name, _, value = item.partition("=")
        name, value = name.strip().replace("-", "_"), value.strip()
        if name not in CHOICES:
            raise ValueError(f"kernel setting {name!r} unknown: use one of {', '.join(CHOICES)}")
        if value not in CHOICES[name]:
            raise ValueError(f"kernel setting {name}={value!r}: use one of {', '.join(CHOICES[name])}")
        out = replace(out, **{name: value})
    return out


def settings() -> KernelSettings:
    global _current
    if _current is None:
        _current = parse(os.environ.get("ARDIT_KERNELS"))
    return _current


def configure(spec: str | KernelSettings | None = None, **changes: str) -> KernelSettings:
    """Set the process-wide kernel settings (a spec string, a KernelSettings, or keywords) and
    return the previous ones, so tests can restore them."""
    global _current
    previous = settings()
    new = spec if isinstance(spec, KernelSettings) else parse(spec, previous)
    _current = parse(",".join(f"{k}={v}" for k, v in changes.items()), new)
    return previous


def fast_device(t: torch.Tensor) -> bool:
    """Where `auto` takes the fast paths: CUDA tensors in bfloat16 (the production setting)."""
    return t.is_cuda and t.dtype == torch.bfloat16


def enabled(name: str, t: torch.Tensor, fast_value: str = "on") -> bool:
    """Whether setting `name` selects its fast path (`fast_value`) for tensor t."""
    value = getattr(settings(), name)
    return value == fast_value or (value == "auto" and fast_device(t))


def prefill_compiled() -> bool:
    """Whether prompt chunks run through the compiled layer regions, in graphs dynamic in the token
    count (`compile_prefill=on`). Off by default: a chunk alone runs faster compiled, but a fresh
    process of the full FP8 job spent minutes compiling its graphs, more than the chunks gained,
    and its effect with warm caches is not measured yet (docs/benchmarks.md). Asked once a
    forward, before its stages: a later pipeline stage has no input when it decides."""
    return settings().compile_prefill == "on"


# An FP8 GEMM of this many rows (tokens, or (token, expert) pairs for the routed experts) or more is
# compute-bound: the DiT's denoising steps and prompt chunks. Below it (AR decode) the GEMM reads
# weights and the accumulation mode costs nothing, so the exact one stays.
FAST_ACCUM_MIN_ROWS = 1024


def fast_accumulation(rows: int) -> bool:
    """Whether an FP8 GEMM of `rows` rows accumulates in the tensor cores' fast mode (Hopper's FP8
    MMA adds into its own reduced-precision accumulator instead of promoting partial sums to fp32
    registers; vLLM's FP8 CUTLASS kernels use it too). `fp8_accum=auto`: fast from
    FAST_ACCUM_MIN_ROWS rows, where it makes the DiT step faster and its output stays as close to
    the bf16 model's as exact accumulation's (docs/benchmarks.md); exact below, and exact always
    under `batch_invariant=on`. A job's `--batch-invariant` (the AR's Admission) keeps `auto`: each
    GEMM of its rows is one row's (its prompt chunks, its decode steps, its DiT steps), so the mode
    follows the row alone and the row stays independent of its batch (test_engine_fp8.py)."""
    s = settings()
    if s.fp8_accum != "auto":
        return s.fp8_accum == "fast"
    if s.batch_invariant == "on":
        return False
    # A branch, not `return rows >= ...`: under torch.compile a dynamic row count makes that a SymBool,
    # which is no kernel argument (the GEMM graph-broke and every linear became a frame of its own);
    # the branch makes the graph guard on the side it took and hands the GEMM a plain bool.
    if rows >= FAST_ACCUM_MIN_ROWS:
        return True
    return False


# -- fallbacks: a fast path that fails on some shape runs the plain path there ---------------------
# A compile or kernel failure (an InductorError, a Triton resource error, a CUDA graph that cannot be
# captured) must cost a slower step, never a failed row: `run_fast` computes the plain path instead
# and remembers the (path, shape key) so later calls go straight to it. `fallbacks()` counts those
# decisions in this process; the steps report the count per row and shard as `kernel_fallbacks`.
_plain_keys: set = set()
_proven_keys: set = set()  # tensor-parallel regions whose fast path every rank has run once
_fallbacks = 0
_first_error: str | None = None


def fallbacks() -> int:
    """How many (fast path, shape) pairs fell back to the plain path in this process so far."""
    return _fallbacks


class FallbacksSince:
    """Fallbacks since the last `take()`: a step hands each new one to exactly one row."""

    def __init__(self) -> None:
        self.seen = fallbacks()

    def take(self) -> int:
        now = fallbacks()
        new, self.seen = now - self.seen, now
        return new


def first_error() -> str | None:
    """The error of the first fallback in this process (None: none yet)."""
    return _first_error


class RankLost(RuntimeError):
    """A collective failed: another rank of the group died or hung. Never a row's own error: the
    step stops (nothing of the shard is committed) and the launcher reports the rank that failed.
    (Raised by `parallel.py`; defined here, the engine's lowest layer, because `is_kernel_failure`
    must let it through.)"""


def is_kernel_failure(error: BaseException) -> bool:
    """Whether an exception from a fast path is the kernel's or compiler's failure, which the plain
    path avoids; out of memory, a lost rank and bad inputs (ValueError, TypeError, IndexError,
    KeyError: the plain path would reject them too) are not, and must reach the caller."""
    if not isinstance(error, Exception):
        return False
    return not isinstance(error, (torch.OutOfMemoryError, RankLost, ValueError, TypeError, IndexError, KeyError))


NESTED_TRACE = "symbolically trace a dynamo-optimized function"


def is_nested_trace(error: BaseException) -> bool:
    """Whether `error` is a compiled call that met another thread's trace (compiled.COMPILED_CALLS
    says why): a passing state, not a broken kernel."""
    return isinstance(error, RuntimeError) and NESTED_TRACE in str(error)


def record_fallback(path: str, key, error: BaseException) -> None:
    """Count one fallback and send `key` of `path` to the plain path from now on; the first error of
    the process goes to stderr (one line)."""
    global _fallbacks, _first_error
    _plain_keys.add((path, key))
    _fallbacks += 1
    if _first_error is None:
        import sys

        _first_error = f"{path} {key}: {type(error).__name__}: {error}".replace("\n", " ")[:2000]
        print(f"ardit: kernel fallback (plain path from now on for this shape; later ones are only counted): "
              f"{_first_error}", file=sys.stderr, flush=True)


def reset_fallbacks() -> None:
    """Forget fallback decisions and counts (tests)."""
    global _fallbacks, _first_error
    _plain_keys.clear()
    _proven_keys.clear()
    _fallbacks, _first_error = 0, None


def run_fast(path: str, key, fast, plain, parallel=None):
    """fast() unless (path, key) fell back before; when fast() fails with a kernel failure, record
    the fallback and return plain(), which must compute the same thing from the same inputs (so
    fast() may not have changed them in a way plain() does not redo).

    parallel: the rank's ParallelContext when fast() holds collectives (a compiled layer region): a
    fast path that failed after some of them could not be redone without desynchronising the ranks.
    So the first call of a new key under tensor parallelism is a trial with the collectives off
    (`ParallelContext.collectives_off`: it compiles every part, its result is discarded), the ranks
    agree (`all_true`) and all take the fast path, or all the plain one. A region without collectives
    passes parallel=None: a rank may then take the plain path alone, its collectives are the same.
    Inside an outer torch.compile or a CUDA graph capture it runs fast() as is (the outer region or
    the capture has its own fallback: a failed capture invalidates the stream for any plain path)."""
    if (path, key) in _plain_keys:  # also while capturing: the capture's warm-up fell back
        return plain()
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return fast()
    if parallel is None or parallel.world_size == 1:
        try:
            return fast()
        except Exception as e:  # noqa: BLE001 - kernel failures only, the rest is raised again
            if is_nested_trace(e):
                return plain()  # another thread was tracing: this call only, the fast path is not broken
            if not is_kernel_failure(e):
                raise
            record_fallback(path, key, e)
            return plain()
    if (path, key) not in _proven_keys:
        error = None
        try:
            with parallel.collectives_off():
                fast()
        except Exception as e:  # noqa: BLE001 - kernel failures only, the rest is raised again
            if not is_kernel_failure(e):
                raise
            error = e
        if not parallel.all_true(error is None):
            record_fallback(path, key, error or RuntimeError("another tensor-parallel rank's fast path failed"))
            return plain()
        _proven_keys.add((path, key))
    return fast()


def moe_key(x: torch.Tensor) -> tuple:
    """The fallback key of a routed-expert dispatch over tokens x [N, H]: N rounded up to a power of
    two (its compiled parts are dynamic in N), the width and the dtype."""
    return (1 << max(x.shape[0] - 1, 0).bit_length(), x.shape[-1], x.dtype)
