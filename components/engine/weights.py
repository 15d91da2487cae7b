"""Weights: official checkpoint names, sharded safetensors with an index, and dummy init.

The engine stores routed experts stacked ([E, 2I, H] / [E, H, I]) for the grouped GEMM; the
checkpoint has one module per expert:

    model.layers.{i}.mlp.experts.{e}.gate_and_up_proj.weight   <->  experts.gate_and_up_proj[e]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight          <->  experts.down_proj[e]

Every other parameter keeps its name (`.weight` / `.bias` as in the official modules).

Loading reads one tensor at a time from memory-mapped shards and copies it straight into the
parameter on its device and in its dtype: host memory holds at most one tensor beyond the mapped
files, never a second copy of the model. A model that tensor parallelism has sliced reads only its
slices (`safe_open(...).get_slice`), described by `LoadSlices` attached to the model.
"""

from __future__ import annotations

import json
import re
import resource
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import HunyuanImage3Config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_and_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """The checkpoint files do not match the model; the message says which tensor and how."""


@dataclass
class LoadSlices:
    """What a rank of a sliced (tensor/expert parallel) model reads of each checkpoint tensor.

    ranges: ardit parameter name -> (dim, [(start, end), ...], full size of dim): the local tensor
            is the concatenation of those ranges of the full tensor along `dim` (two ranges for a
            fused gate/up projection split per half). For stacked experts, dim counts the expert
            axis (dim 1 is an expert weight's first dim).
    experts: stacked-experts parameter name (`model.layers.i.mlp.experts.gate_and_up_proj`) ->
             (first, end): the global expert ids this rank holds.
    skip: name prefixes this rank does not hold at all (another pipeline stage's decoder layers).
    """

    ranges: dict[str, tuple[int, list[tuple[int, int]], int]] = field(default_factory=dict)
    experts: dict[str, tuple[int, int]] = field(default_factory=dict)
    skip: tuple[str, ...] = ()


@dataclass
class LoadStats:
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    peak_host_rss_gb: float = 0.0


def official_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every parameter and buffer, experts split per expert."""
    slices: LoadSlices = getattr(model, "load_slices", None) or LoadSlices()
    for name, tensor in model.state_dict().items():
        m = _STACKED_RE.match(name)
        if m:
            first = slices.experts.get(name, (0, tensor.shape[0]))[0]
            for e in range(tensor.shape[0]):
                yield f"{m.group(1)}.{first + e}.{m.group(2)}.weight", tensor[e]
        else:
            yield name, tensor


def save_pretrained(model: nn.Module, config: HunyuanImage3Config, directory: str | Path,
                    max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> Path:
    """Write config.json, model-0000k-of-0000n.safetensors shards and the index (official layout).

    dtype: cast floating tensors (e.g. bf16 as released); None keeps each tensor's own dtype."""

    def tensors():
        for name, tensor in official_tensors(model):
            tensor = tensor.detach()
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    return write_checkpoint(tensors(), config.to_dict(), directory, max_shard_bytes)


def write_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], config: dict, directory: str | Path,
                     max_shard_bytes: int = 2 << 30) -> Path:
    """(name, tensor) pairs as safetensors shards of at most max_shard_bytes, the index, config.json."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=1))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def checkpoint_files(directory: str | Path, prefix: str = "") -> list[Path]:
    """The safetensors files of a checkpoint directory (from its index, else model.safetensors);
    with `prefix`, only the files that hold tensors whose names start with it."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        files = [directory / f for f in sorted({f for n, f in weight_map.items() if n.startswith(prefix)})]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{directory} lacks {len(missing)} shard(s) named in {INDEX_FILE}, e.g. "
                                  f"{missing[0]}: the download is incomplete")
        return files
    if (directory / SINGLE_FILE).exists():
        return [directory / SINGLE_FILE]
    raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {directory}")


def _read(handle, name: str, spec) -> torch.Tensor:
    """The whole tensor, or the concatenation of `spec`'s ranges along its dim (reading only those)."""
    if spec is None:
        return handle.get_tensor(name)
    dim, ranges = spec[0], spec[1]
    part = handle.get_slice(name)
    pieces = []
    for start, end in ranges:
        index = [slice(None)] * len(part.get_shape())
        index[dim] = slice(start, end)
        pieces.append(part[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


@torch.no_grad()
def load_pretrained(model: nn.Module, directory: str | Path, strict: bool = True,
                    on_tensor: Callable[[str], None] | None = None, prefix: str = "",
                    skip_prefixes: tuple[str, ...] = ()) -> LoadStats:
    """Load official-named sharded safetensors into `model` in place, shard by shard.

    Each tensor is read (only this rank's slice of it when the model is sliced), cast to the
    parameter's dtype and copied onto the parameter's device. strict: every model tensor must come
    from the checkpoint and every checkpoint tensor must have a place in the model.
    prefix / skip_prefixes: load only the tensors whose names start with `prefix` and with none of
    `skip_prefixes` (loading one decoder layer at a time; strictness holds within that part).
    """
    from safetensors import safe_open

    t0 = time.perf_counter()
    stats = LoadStats()
    slices: LoadSlices = getattr(model, "load_slices", None) or LoadSlices()
    skip_prefixes = tuple(skip_prefixes) + slices.skip  # another pipeline stage's layers are not read

    def wanted(name: str) -> bool:
        return name.startswith(prefix) and not name.startswith(skip_prefixes or ("\0",))
    params = model.state_dict(keep_vars=True)
    expected = {name for name, _ in official_tensors(model) if wanted(name)}
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(directory, prefix):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not wanted(name):
                    continue
                m = _EXPERT_RE.match(name)
                if m:
                    stacked = f"{m.group(1)}.{m.group(3)}"
                    holder = params.get(stacked)
                    first, end = slices.experts.get(stacked, (0, None if holder is None else holder.shape[0]))
                    e = int(m.group(2))
                    if holder is not None and not first <= e < end:
                        continue  # another rank's expert
                    target = None if holder is None else holder[e - first]
                    spec = _expert_spec(slices.ranges.get(stacked))
                else:
                    param = params.get(name)
                    target = None if param is None else param.data
                    spec = slices.ranges.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                tensor = _read(f, name, spec)
                if tensor.shape != target.shape:
                    raise CheckpointError(f"{path.name}: {name} has shape {tuple(tensor.shape)}, the model built "
                                          f"from config.json expects {tuple(target.shape)}")
                target.copy_(tensor.to(dtype=target.dtype))
                stats.tensors += 1
                stats.bytes_read += tensor.numel() * tensor.element_size()
                seen.add(name)
                if on_tensor is not None:
                    on_tensor(name)
                del tensor
    missing = sorted(expected - seen)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensor(s) missing from the checkpoint (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensor(s) the model has no place for "
                         f"(e.g. {', '.join(sorted(unexpected)[:3])})")
        raise CheckpointError(f"checkpoint {directory} does not match config.json: " + "; ".join(parts))
    stats.seconds = time.perf_counter() - t0
    stats.peak_host_rss_gb = peak_rss_gb()
    return stats


def peak_rss_gb() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, prefix: str = "", skip_prefixes: tuple[str, ...] = ()) -> None:
    """`dummy` load format: every weight random (no file), norms at one, biases at zero.

    Weights are N(0, 1/fan_in) so activations keep unit scale through the random network, and the
    zero-initialised output convs of training are random too: every path carries signal, so
    reuse-vs-recompute tests can fail. Each tensor's values depend only on (seed, its official
    name), drawn at its full size: a sliced (tensor/expert parallel) model holds exactly the slices
    of the unsliced one.
    """
    slices: LoadSlices = getattr(model, "load_slices", None) or LoadSlices()
    for name, p in model.named_parameters():
        if not name.startswith(prefix) or (skip_prefixes and name.startswith(skip_prefixes)):
            continue
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:  # norm weights
            p.fill_(1.0)
        elif _STACKED_RE.match(name):
            m = _STACKED_RE.match(name)
            first = slices.experts.get(name, (0, 0))[0]
            spec = _expert_spec(slices.ranges.get(name))
            for e in range(p.shape[0]):
                official = f"{m.group(1)}.{first + e}.{m.group(2)}.weight"
                p[e].copy_(_dummy(official, p[e].shape, spec, p.device, seed))
        else:
            p.copy_(_dummy(name, p.shape, slices.ranges.get(name), p.device, seed))


def _expert_spec(spec):
    """A stacked-experts range spec, re-expressed for one expert's own tensor (drop the expert axis)."""
    return None if spec is None else (spec[0] - 1, spec[1], spec[2])


def _dummy(name: str, local_shape: torch.Size, spec, device, seed: int) -> torch.Tensor:
    shape = list(local_shape)
    if spec is not None:
        shape[spec[0]] = spec[2]
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(fan_in ** -0.5)
    if spec is None:
        return noise
    dim, ranges = spec[0], spec[1]
    return torch.cat([noise.narrow(dim, start, end - start) for start, end in ranges], dim=dim)
