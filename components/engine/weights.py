"""Weights: official checkpoint names, sharded safetensors with an index, and dummy init.

The engine stores routed experts stacked ([E, 2I, H] / [E, H, I]) for the grouped GEMM; the
checkpoint has one module per expert:

    model.layers.{i}.mlp.experts.{e}.gate_and_up_proj.weight   <->  experts.gate_and_up_proj[e]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight          <->  experts.down_proj[e]

Every other parameter keeps its name (`.weight` / `.bias` as in the official modules).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .config import HunyuanImage3Config

INDEX_FILE = "model.safetensors.index.json"
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_and_up_proj|down_proj)$")


def official_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every parameter and buffer, experts split per expert."""
    for name, tensor in model.state_dict().items():
        m = _STACKED_RE.match(name)
        if m:
            for e in range(tensor.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", tensor[e]
        else:
            yield name, tensor


def save_pretrained(model: nn.Module, config: HunyuanImage3Config, directory: str | Path,
                    max_shard_bytes: int = 2 << 30) -> Path:
    """Write config.json, model-0000k-of-0000n.safetensors shards and the index."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in official_tensors(model):
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
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    return directory


def load_pretrained(model: nn.Module, directory: str | Path, strict: bool = True) -> None:
    """Load official-named sharded safetensors (or one model.safetensors) into `model` in place."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no {INDEX_FILE} or model.safetensors in {directory}")
    params = model.state_dict()
    seen: set[str] = set()
    unexpected: list[str] = []
    for fname in files:
        with safe_open(str(directory / fname), framework="pt") as f:
            for name in f.keys():
                m = _EXPERT_RE.match(name)
                if m:
                    target_name = f"{m.group(1)}.{m.group(3)}"
                    target = params.get(target_name)
                    target = None if target is None else target[int(m.group(2))]
                else:
                    target_name, target = name, params.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                if tensor.shape != target.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                seen.add(name)
    expected = {name for name, _ in official_tensors(model)}
    missing = sorted(expected - seen)
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint mismatch: {len(missing)} missing (e.g. {missing[:3]}), "
                         f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """`dummy` load format: every weight random (no file), norms at one, biases at zero.

    Weights are N(0, 1/fan_in) so activations keep unit scale through the random network, and the
    zero-initialised output convs of training are random too: every path carries signal, so
    reuse-vs-recompute tests can fail.
    """
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:  # norm weights
            p.fill_(1.0)
        else:
            fan_in = p.shape[-1] if ".experts." in name else p[0].numel()
            gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(noise.mul_(fan_in ** -0.5).to(p.dtype))
