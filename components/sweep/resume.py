"""What a config's run was made with, so that a resumed sweep never shows an old run under new labels.

Before a config runs, `runs/{config}.settings.json` records its effective settings (the job
parameters as the spec gives them: a parameter left out means "the model's generation config",
recorded by the digest of a checkpoint's generation_config.json; the dataset as written in the
spec; and for a config that takes another run's AR outputs that run's fingerprint) and their
fingerprint. On `--resume`, a run whose recorded fingerprint differs from the
spec's is moved to `replaced/` and run again, with one line saying what changed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from components.sweep.spec import SweepConfig

SETTINGS_SUFFIX = ".settings.json"
REPLACED_DIR = "replaced"
_UNSET = "(model default)"


class ResumeError(ValueError):
    """The sweep directory cannot be run as asked (one line: what, where, how to fix)."""


def generation_config_digest(model: Any) -> str | None:
    """A digest of the checkpoint's generation_config.json, where the settings a spec leaves out come
    from; None for a preset (its generation config is code, named by the preset) or an unresolvable
    model (the job reports that itself)."""
    from components.engine.resolve import resolve_model  # no torch: path and HF-cache lookups only

    try:
        resolved = resolve_model(str(model))
    except Exception:  # noqa: BLE001  (ModelNotFound, a broken cache: the run says why)
        return None
    path = resolved.path / "generation_config.json" if resolved.path else None
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path and path.is_file() else None


def config_settings(cfg: SweepConfig, fingerprints: dict[str, str]) -> dict[str, Any]:
    """The settings that decide a config's images (None values are left to the job, so omitted; the
    generation config they then come from is part of the settings by its digest)."""
    settings: dict[str, Any] = {"params": {k: v for k, v in sorted(cfg.params.items()) if v is not None}}
    digest = generation_config_digest(cfg.params.get("model", "tiny"))
    if digest:
        settings["generation_config"] = digest
    if cfg.ar_from:
        settings["ar_from"] = {"config": cfg.ar_from, "fingerprint": fingerprints.get(cfg.ar_from)}
    return settings


def fingerprint(settings: dict[str, Any]) -> str:
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def settings_path(runs: Path, name: str) -> Path:
    return runs / f"{name}{SETTINGS_SUFFIX}"


def read_settings(runs: Path, name: str) -> dict[str, Any] | None:
    path = settings_path(runs, name)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def write_settings(runs: Path, name: str, settings: dict[str, Any], fp: str) -> None:
    settings_path(runs, name).write_text(json.dumps({"fingerprint": fp, "settings": settings}, indent=2, default=str))


def _show(v: Any) -> str:
    return _UNSET if v is None else json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)


def describe_change(recorded: dict[str, Any] | None, settings: dict[str, Any]) -> str:
    """'guidance 5.0 → 3.0, steps (model default) → 4' or why nothing can be compared."""
    if recorded is None or "settings" not in recorded:
        return "no settings recorded with the existing run"
    old, new = recorded["settings"], settings
    old_p, new_p = old.get("params", {}), new.get("params", {})
    parts = [f"{k} {_show(old_p.get(k))} → {_show(new_p.get(k))}"
             for k in sorted(set(old_p) | set(new_p)) if old_p.get(k) != new_p.get(k)]  # fmt: skip
    if old.get("generation_config") != new.get("generation_config"):
        parts.append("the model's generation_config.json changed")
    if old.get("ar_from") != new.get("ar_from"):
        src = (new.get("ar_from") or {}).get("config") or (old.get("ar_from") or {}).get("config")
        parts.append(f"AR outputs now come from a changed run of {src}")
    return ", ".join(parts) or "settings differ"


def move_aside(sweep_dir: Path, runs: Path, name: str, old_fp: str | None, prefix: str = "") -> Path:
    """Move a config's run (and its settings/error files) to `replaced/[{prefix}-]{name}-{fingerprint}`."""
    stem = f"{prefix}-{name}" if prefix else name
    target = sweep_dir / REPLACED_DIR / f"{stem}-{old_fp or 'unrecorded'}"
    n = 1
    while target.exists():
        n += 1
        target = sweep_dir / REPLACED_DIR / f"{stem}-{old_fp or 'unrecorded'}-{n}"
    target.mkdir(parents=True)
    for path in (runs / name, settings_path(runs, name), runs / f"{name}.error.txt"):
        if path.exists():
            shutil.move(str(path), str(target / path.name))
    return target


def existing_runs(runs: Path, names: list[str]) -> list[str]:
    return [n for n in names if (runs / n).exists() or settings_path(runs, n).exists()]
