"""Which kernels the engine runs: the plain PyTorch paths (the reference, used on CPU) or the fast
CUDA paths (flex attention with block masks, fused MoE dispatch, CUDA-graph decode, compiled DiT
layers). Every fast path is compared against its plain path in tests or benchmarks.

Settings are process-wide, like `torch.backends` flags: `configure("attention=flex,moe=fused")`,
or the `ARDIT_KERNELS` environment variable in the same form (read at first use). A value of
`auto` picks the fast path for CUDA bfloat16 tensors and the plain one otherwise.
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
    "compile": ("auto", "off", "on"),             # torch.compile per decoder layer (DiT steps)
    "batch_invariant": ("off", "on"),             # a row is bitwise independent of its batch
}


@dataclass(frozen=True)
class KernelSettings:
    attention: str = "auto"
    moe: str = "auto"
    decode_graphs: str = "auto"
    compile: str = "auto"
    batch_invariant: str = "off"

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
                          decode_graphs="on" if fast else "off", compile="on" if fast else "off")
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
