"""What the AR and DiT step programs share: engine loading, the default KV store, validators."""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache
from typing import Callable

from components.kvstore.base import make_key

# A prompt longer than this many tokens is an error row (the model's context must also hold the
# conditioning images, the CoT and the generated image).
MAX_PROMPT_TOKENS = {"tiny": 256, "hunyuan-image-3": 2048}


def default_kv_store(output: str, run_id: str) -> str:
    """The embedded KV store: a directory beside the outputs (or in the temp dir for s3:// outputs,
    in which case AR and DiT must run on the same machine)."""
    if "://" in output and not output.startswith("file://"):
        return "local://" + os.path.join(tempfile.gettempdir(), "ardit-kv", run_id)
    root = output.removeprefix("file://")
    return "local://" + os.path.abspath(os.path.join(root, run_id, "_kv"))


def kv_key(run_id: str, shard: int, row_id: str) -> str:
    from components.data.runs import row_key

    return make_key(run_id, shard, row_key(row_id))


@lru_cache(maxsize=2)
def load_engine(model: str, weights: str | None, device: str, dtype: str | None, seed: int = 0):
    """One engine per process, whatever number of shards it serves."""
    from components.engine import Engine

    return Engine.load(model, weights=weights, device=device, dtype=dtype, seed=seed)


def model_validators(model: str) -> tuple[Callable[[str], int], Callable[[int, int], bool], int]:
    """(count_tokens, is_supported_size, max_prompt_tokens) for a model, without loading weights."""
    from pathlib import Path

    from components.engine.config import HunyuanImage3Config, get_config
    from components.engine.sequence import ResolutionGroup
    from components.engine.tokenizer import load_tokenizer

    if Path(model).is_dir():
        import json

        config = HunyuanImage3Config.from_dict(json.loads((Path(model) / "config.json").read_text()))
        tokenizer = load_tokenizer(model)
        max_tokens = MAX_PROMPT_TOKENS["hunyuan-image-3"]
    else:
        config = get_config(model)
        tokenizer = load_tokenizer(None if model == "tiny" else model)
        max_tokens = MAX_PROMPT_TOKENS.get(model, 2048)
    buckets = ResolutionGroup(config.image_base_size)
    return (lambda text: len(tokenizer.encode(text)),
            lambda w, h: buckets.index_of(w, h) is not None,
            max_tokens)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_args(p) -> None:
    """Arguments the AR and DiT step programs share."""
    p.add_argument("--output", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--model", default="tiny", help="preset (tiny, hunyuan-image-3) or a checkpoint directory")
    p.add_argument("--weights", default=None, help="safetensors directory; omitted = seeded random (dummy) weights")
    p.add_argument("--kv-store", default=None, help="local:///dir or mooncake://host:port?metadata=...")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the model config's)")
    p.add_argument("--seed", type=int, default=0, help="base seed for rows without their own")


def engine_kwargs(args) -> dict:
    kv_store = args.kv_store or None
    if kv_store and kv_store.startswith("$("):
        raise SystemExit(f"--kv-store {kv_store!r} is an unexpanded variable: set it in the ardit-endpoints ConfigMap")
    return {"model": args.model, "weights": args.weights, "kv_store": kv_store,
            "device": resolve_device(args.device), "dtype": args.dtype, "seed": args.seed}
