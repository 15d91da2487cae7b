"""Which model a job names, what it is without its weights, and its engine, loaded once per process.

`resolve_model` turns a preset, checkpoint directory or Hugging Face repo id into a ModelRef (or
one ConfigError line); `describe_model` reads its config, tokenizer and generation config;
`load_engine` loads the engine the AR and DiT steps share (one per process, or per rank).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from components.errors import ConfigError

# A prompt longer than this many tokens is an error row (the model's context must also hold the
# conditioning images, the CoT and the generated image).
MAX_PROMPT_TOKENS = {"tiny": 256, "hunyuan-image-3": 2048}


@dataclass(frozen=True)
class ModelRef:
    """A model the engine can load: a preset (`path` None) or a checkpoint directory."""

    kind: str  # "preset" | "dir"
    name: str
    path: Path | None = None


def resolve_model(model: str) -> ModelRef:
    """Preset, checkpoint directory or Hugging Face repo id (local cache) -> ModelRef; ConfigError
    (one line saying how to fix it) otherwise."""
    from components.engine import resolve as engine_resolve

    try:
        r = engine_resolve.resolve_model(model)
    except engine_resolve.ModelNotFound as exc:
        raise ConfigError(f"--model {model}: {exc}") from None
    return ModelRef(r.kind, r.name, Path(r.path) if r.kind == "dir" else None)


def _engine_load_kwargs(dummy_weights: bool, tensor_parallel_size: int, quantization: str | None,
                        pipeline_parallel_size: int = 1) -> dict:
    """The Engine.load keywords of CONTRACTS.md, passed only when they differ from their
    defaults (so an engine that predates them still loads the default configuration)."""
    extra: dict[str, Any] = {}
    if dummy_weights:
        extra["dummy_weights"] = True
    if tensor_parallel_size != 1:
        extra["tensor_parallel_size"] = tensor_parallel_size
    if pipeline_parallel_size != 1:
        extra["pipeline_parallel_size"] = pipeline_parallel_size
    if quantization:
        extra["quantization"] = quantization
    return extra


def load_engine(model: str, weights: str | None, device: str, dtype: str | None, seed: int = 0,
                dummy_weights: bool = False, tensor_parallel_size: int = 1, quantization: str | None = None,
                parallel: Any = None, pipeline_parallel_size: int = 1):
    """One engine per process, whatever number of shards it serves. `parallel`: this rank's
    ParallelContext when the step runs on tensor- / pipeline-parallel ranks (components.runtime.ranks passes it)."""
    if parallel is not None:  # a rank of a RankPool: it keeps its engine for the job's next steps
        key = (model, weights, device, dtype, seed, dummy_weights, tensor_parallel_size, quantization, id(parallel),
               pipeline_parallel_size)
        if key not in _rank_engines:
            from components.engine import Engine

            if parallel.is_first:
                announce_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device,
                              pipeline_parallel_size)
            _rank_engines.clear()  # one engine per rank process: a new model replaces the old one
            _rank_engines[key] = Engine.load(model, weights=weights, device=device, dtype=dtype, seed=seed,
                                             parallel=parallel,
                                             **_engine_load_kwargs(dummy_weights, tensor_parallel_size, quantization,
                                                                   pipeline_parallel_size))
        return _rank_engines[key]
    return _cached_engine(model, weights, device, dtype, seed, dummy_weights, tensor_parallel_size, quantization)


_rank_engines: dict[tuple, Any] = {}


@lru_cache(maxsize=2)
def _cached_engine(model: str, weights: str | None, device: str, dtype: str | None, seed: int,
                   dummy_weights: bool, tensor_parallel_size: int, quantization: str | None):
    from components.engine import Engine

    announce_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device)
    return Engine.load(model, weights=weights, device=device, dtype=dtype, seed=seed,
                       **_engine_load_kwargs(dummy_weights, tensor_parallel_size, quantization))


def announce_load(model: str, weights: str | None, dummy_weights: bool, quantization: str | None,
                  tensor_parallel_size: int = 1, device: str = "cuda", pipeline_parallel_size: int = 1) -> None:
    """One line before the engine loads (a real checkpoint takes minutes): which model, how big,
    from where."""
    what = describe_load(model, weights, dummy_weights, quantization, tensor_parallel_size, device,
                         pipeline_parallel_size)
    print(f"loading model {what} …", file=sys.stderr, flush=True)


def describe_load(model: str, weights: str | None, dummy_weights: bool, quantization: str | None = None,
                  tensor_parallel_size: int = 1, device: str = "cuda", pipeline_parallel_size: int = 1) -> str:
    """'NAME (SIZE, from WHERE)': the checkpoint's safetensors bytes and directory, or the preset
    and its seeded random weights."""
    ref = resolve_model(model)
    ranks = tensor_parallel_size * pipeline_parallel_size  # a model copy's ranks: GPUs, or CPU processes
    extras = ([f"quantized to {quantization} at load"] if quantization else []) + \
        ([f"{ranks} {'GPUs' if device.startswith('cuda') else 'CPU processes'}"] if ranks > 1 else [])
    directory = Path(weights).expanduser() if weights else ref.path
    if directory is None or dummy_weights:
        config = f", config from {ref.path}" if ref.path is not None else ""
        size = "tiny test size" if ref.name == "tiny" else "80B full size"
        return f"{ref.name} ({', '.join([size, *extras])}, from seeded random weights{config}: nothing read)"
    from components.engine.weights import checkpoint_files

    files = checkpoint_files(directory)
    size = f"{sum(f.stat().st_size for f in files) / 1e9:.1f} GB in {len(files)} safetensors file(s)"
    return f"{ref.name} ({', '.join([size, *extras])}, from {directory})"


def describe_model(model: str) -> tuple[ModelRef, Any, Any, Any]:
    """(ref, config, tokenizer, generation config or None) of a model, without its weights;
    ConfigError when it cannot be described (no tokenizer files, unreadable config, ...)."""
    ref = resolve_model(model)
    try:
        from components.engine.engine import describe
        from components.engine.resolve import ResolvedModel

        config, tokenizer, generation_config, _ = describe(ResolvedModel(ref.kind, ref.path, ref.name))
        return ref, config, tokenizer, generation_config
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--model {model}: cannot load its config/tokenizer/generation config ({first}); pass "
                          "a checkpoint directory with config.json, generation_config.json and the tokenizer "
                          "files") from None


def model_validators(model: str) -> tuple[Callable[[str], int], Callable[[int, int], bool], int]:
    """(count_tokens, is_supported_size, max_prompt_tokens) for a model, without loading weights."""
    from components.data.datasets import SizeRule
    from components.engine.sequence import ResolutionGroup

    ref, config, tokenizer, _ = describe_model(model)
    max_tokens = MAX_PROMPT_TOKENS.get(ref.name, MAX_PROMPT_TOKENS["hunyuan-image-3"]) if ref.kind == "preset" \
        else MAX_PROMPT_TOKENS["hunyuan-image-3"]
    buckets = ResolutionGroup(config.image_base_size)
    sizes = SizeRule(lambda w, h: buckets.index_of(w, h) is not None,
                     ", ".join(f"{r.width}x{r.height}" for r in buckets.data))
    return (lambda text: len(tokenizer.encode(text)), sizes, max_tokens)
