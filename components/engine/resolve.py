"""Turn what a user passes as `--model` into something the engine can load.

    tiny | hunyuan-image-3            a preset: config in code, random (dummy) weights
    demo                              the small checkpoint the project trained on procedural scenes,
                                      installed with the package (components/engine/assets/demo)
    /path/to/checkpoint               a directory in the official layout (config.json, shards, tokenizer)
    tencent/HunyuanImage-3.0-Instruct a Hugging Face repo id, resolved through the local HF cache only

Nothing here downloads: a repo id absent from the cache is a one-line error that says how to get it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PRESETS = ("tiny", "hunyuan-image-3", "hunyuan-image-3-distil")
DEMO = "demo"
DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(ValueError):
    """The model cannot be resolved; the message is one line that says how to fix it."""


@dataclass(frozen=True)
class ResolvedModel:
    kind: str  # "preset" | "dir"
    path: Path | None  # the checkpoint directory (None for presets)
    name: str  # a short id recorded with outputs and KV payloads


def resolve_model(model: str) -> ResolvedModel:
    if model in PRESETS:
        return ResolvedModel("preset", None, model)
    if model == DEMO:
        if not (DEMO_DIR / "config.json").is_file():
            raise ModelNotFound(f"the demo checkpoint is not installed ({DEMO_DIR} has no config.json): reinstall "
                                "ardit, or train it: python -m components.demo.train --out " + str(DEMO_DIR))
        return ResolvedModel("dir", DEMO_DIR, DEMO)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model directory {path} has no config.json: point --model at a HunyuanImage-3 "
                                "checkpoint directory (config.json, *.safetensors, tokenizer files)")
        return ResolvedModel("dir", path.resolve(), path.resolve().name)
    if _REPO_ID.match(model) and not model.startswith((".", "/", "~")):
        return ResolvedModel("dir", _from_hf_cache(model), model.split("/")[-1])
    if path.exists():
        raise ModelNotFound(f"--model {model} is a file, not a checkpoint directory")
    if "/" in model or model.startswith((".", "~")):
        raise ModelNotFound(f"checkpoint directory {model} does not exist")
    raise ModelNotFound(f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}), {DEMO}, a checkpoint "
                        "directory "
                        "or a Hugging Face repo id such as tencent/HunyuanImage-3.0-Instruct")


def _from_hf_cache(repo_id: str) -> Path:
    """The snapshot directory of `repo_id` in the local Hugging Face cache (never the network)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError as e:  # transformers depends on it, so this is a broken install
        raise ModelNotFound(f"huggingface_hub is missing ({e}); reinstall ardit") from None
    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, RepositoryNotFoundError, ...
        raise ModelNotFound(f"{repo_id} is not in the local Hugging Face cache ({HF_HUB_CACHE}); download it "
                            f"first: hf download {repo_id}  (or pass --model DIR for a checkout elsewhere)") from None
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"the cached snapshot of {repo_id} at {path} has no config.json: the download is "
                            f"incomplete; run: hf download {repo_id}")
    return path
