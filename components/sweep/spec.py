"""Sweep spec: a base job, a grid over its parameters, the reference, thresholds and the
precision-budget configs. Loaded from YAML; every key, its default and the failure rules are in
docs/sweeps.md (see also examples/sweeps/tiny.yaml, fp8.yaml):

```yaml
name: tiny
base: {dataset: ..., kind: edit, model: tiny, num_shards: 2, seed: 42, kv_reuse: true, temperature: 0.7}
grid: {kv_reuse: [true, false], steps: [8, 4]}
reference: {kv_reuse: true, steps: 8}        # grid values, or a config name
thresholds: {psnr_min: 30, ssim_min: 0.97, mean_abs_max: 0.03, p99_abs_max: 0.30}
overrides:                                   # per-config thresholds (None disables a gate)
  - match: {steps: 4}
    thresholds: {psnr_min: 12}
configs:                                     # optional extra configs, by name
  - {name: greedy, params: {temperature: 0.0}}
precision_budget: {determinism: true, reuse_drift: true, ar_diversity: {seed: 43}, gate: false}
timing: {repeats: 0}                         # extra interleaved timing rounds
```
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from components.evaluate.gates import Thresholds
from components.sweep.params import GRID_PARAMS, JOB_PARAMS, check_value, name_part, suggestion

# Job settings the spec does not give are left to the job: generation settings (steps, guidance,
# ...) then come from the model's generation config, as with `ardit edit` (components/sweep/params.py).
DEFAULT_BASE: dict[str, Any] = {"kind": "edit", "model": "tiny", "num_shards": 1}
TOP_LEVEL_KEYS = ("name", "description", "base", "grid", "reference", "thresholds", "overrides", "configs",
                  "precision_budget", "timing")  # fmt: skip
BUDGET_KEYS = ("determinism", "reuse_drift", "ar_diversity", "gate")
TIMING_KEYS = ("repeats",)
# size: the scenes' side in pixels; output_size: every row's `size` ("WIDTHxHEIGHT", pinned so that
# every config makes the same shape and is compared on pixels); targets: for the semantic judge
SAMPLE_DATASET_KEYS = ("sample", "rows", "size", "output_size", "seed", "targets")
OVERRIDE_KEYS = ("name", "match", "thresholds", "gate")
EXTRA_CONFIG_KEYS = ("name", "params", "thresholds")

REFERENCE = "reference"
GRID = "grid"
EXTRA = "extra"
DETERMINISM = "determinism"
REUSE_DRIFT = "reuse_drift"
AR_DIVERSITY = "ar_diversity"
BUDGET_ROLES = (DETERMINISM, REUSE_DRIFT, AR_DIVERSITY)

_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SpecError(ValueError):
    """The sweep spec is invalid (message says where)."""


@dataclass
class SweepConfig:
    """One job of the sweep; `baseline` is the config it is evaluated against."""

    name: str
    params: dict[str, Any]
    role: str
    baseline: str | None
    thresholds: Thresholds | None
    varied: dict[str, Any] = field(default_factory=dict)
    ar_from: str | None = None  # run whose AR outputs this config reuses (AR tokens held fixed)

    @property
    def gated(self) -> bool:
        return self.thresholds is not None and self.thresholds.active

    def label(self) -> str:
        """Short human description of what differs from the base job."""
        if not self.varied:
            return "base job"
        return ", ".join(f"{k}={_fmt_value(v)}" for k, v in self.varied.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "role": self.role,
            "baseline": self.baseline,
            "thresholds": self.thresholds.as_dict() if self.thresholds else None,
            "varied": self.varied,
            "ar_from": self.ar_from,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepConfig:
        th = d.get("thresholds")
        return cls(
            name=d["name"],
            params=dict(d["params"]),
            role=d["role"],
            baseline=d.get("baseline"),
            thresholds=Thresholds.from_dict(th) if th is not None else None,
            varied=dict(d.get("varied") or {}),
            ar_from=d.get("ar_from"),
        )


@dataclass
class SweepSpec:
    name: str
    description: str
    base: dict[str, Any]
    configs: list[SweepConfig]
    reference: str
    thresholds: Thresholds
    raw: dict[str, Any]
    timing_repeats: int = 0  # extra interleaved timing rounds over every config (components/sweep/timing.py)

    def config(self, name: str) -> SweepConfig:
        for c in self.configs:
            if c.name == name:
                return c
        raise KeyError(name)

    def grid_table(self) -> list[dict[str, Any]]:
        """The expanded configs as printable rows (for --dry-run)."""
        return [
            {
                "name": c.name,
                "role": c.role,
                "vs": c.baseline or "–",
                "varied": c.label(),
                "ar_from": c.ar_from or "",
                "gates": c.thresholds.describe() if c.gated else "not gated",
            }
            for c in self.configs
        ]


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def config_name(varied: dict[str, Any]) -> str:
    return "-".join(name_part(k, v) for k, v in varied.items()) or "base"


def _check_keys(where: str, data: dict[str, Any], allowed: tuple[str, ...], what: str = "parameter") -> None:
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping")
    unknown = sorted(set(data) - set(allowed), key=str)
    if unknown:
        key = unknown[0]
        raise SpecError(f"{where}: unknown {what} {key!r}{suggestion(str(key), allowed)}; allowed: {list(allowed)}")


def _check_params(where: str, data: dict[str, Any], allowed: tuple[str, ...] = JOB_PARAMS) -> None:
    _check_keys(where, data, allowed)
    for key, value in data.items():
        problem = check_value(f"{where}.{key}", key, value)
        if problem:
            raise SpecError(problem)


def _thresholds(where: str, data: Any) -> Thresholds:
    if data is None:
        return Thresholds()
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping of thresholds")
    try:
        return Thresholds.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{where}: {exc}") from exc


def _apply_overrides(cfg: SweepConfig, overrides: list[dict[str, Any]]) -> None:
    for i, ov in enumerate(overrides):
        name, match = ov.get("name"), ov.get("match")
        hit = (name is not None and name == cfg.name) or (
            match is not None and all(cfg.params.get(k) == v for k, v in match.items())
        )
        if not hit:
            continue
        if ov.get("gate") is False:
            cfg.thresholds = None
            continue
        base = cfg.thresholds or Thresholds()
        try:
            cfg.thresholds = base.merged(ov.get("thresholds") or {})
        except (ValueError, TypeError) as exc:
            raise SpecError(f"overrides[{i}]: {exc}") from exc


def parse_spec(data: dict[str, Any]) -> SweepSpec:
    """Validate a spec mapping and expand it into configs (reference first)."""
    if not isinstance(data, dict):
        raise SpecError("spec must be a mapping")
    _check_keys("spec", data, TOP_LEVEL_KEYS, "top-level key")
    name = str(data.get("name") or "sweep")
    if not _NAME_OK.match(name):
        raise SpecError(f"name {name!r}: use letters, digits, '.', '_' or '-'")
    base = {**DEFAULT_BASE, **(data.get("base") or {})}
    _check_params("base", base)
    if "dataset" not in base:
        raise SpecError("base.dataset is required")
    _check_dataset(base["dataset"])
    if isinstance(base["dataset"], dict) and base["dataset"]["sample"] != base.get("kind"):
        raise SpecError(f"base.dataset.sample is {base['dataset']['sample']!r} but base.kind is {base.get('kind')!r}")

    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise SpecError("grid: expected a mapping of parameter -> list of values")
    _check_keys("grid", grid, GRID_PARAMS)
    for k, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            raise SpecError(f"grid.{k}: expected a non-empty list")
        if len(set(map(json.dumps, vals))) != len(vals):
            raise SpecError(f"grid.{k}: duplicate values {vals}")
        for i, v in enumerate(vals):
            problem = check_value(f"grid.{k}[{i}]", k, v) if v is not None else f"grid.{k}[{i}]: null is not a value"
            if problem:
                raise SpecError(problem)

    thresholds = _thresholds("thresholds", data.get("thresholds"))
    overrides = data.get("overrides") or []
    if not isinstance(overrides, list):
        raise SpecError("overrides: expected a list")
    for i, ov in enumerate(overrides):
        if not isinstance(ov, dict) or not ({"name", "match"} & set(ov)):
            raise SpecError(f"overrides[{i}]: needs 'name' or 'match'")
        _check_keys(f"overrides[{i}]", ov, OVERRIDE_KEYS, "key")
        if ov.get("match") is not None:
            _check_params(f"overrides[{i}].match", ov["match"])

    configs: list[SweepConfig] = []
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        varied = dict(zip(keys, values))
        configs.append(SweepConfig(config_name(varied), {**base, **varied}, GRID, None, thresholds, varied))
    if not configs:
        configs.append(SweepConfig("base", dict(base), GRID, None, thresholds, {}))
    for i, extra in enumerate(data.get("configs") or []):
        if not isinstance(extra, dict) or "name" not in extra:
            raise SpecError(f"configs[{i}]: needs a name")
        _check_keys(f"configs[{i}]", extra, EXTRA_CONFIG_KEYS, "key")
        params = extra.get("params") or {}
        _check_params(f"configs[{i}].params", params)
        th = thresholds.merged(extra["thresholds"]) if extra.get("thresholds") else thresholds
        configs.append(SweepConfig(str(extra["name"]), {**base, **params}, EXTRA, None, th, dict(params)))

    ref = _find_reference(data.get("reference"), configs)
    ref.role = REFERENCE
    ref.thresholds = None
    for c in configs:
        if c is not ref:
            c.baseline = ref.name
            _apply_overrides(c, overrides)
    configs.remove(ref)
    configs.insert(0, ref)
    configs += _budget_configs(data.get("precision_budget"), ref, thresholds, overrides)

    names = [c.name for c in configs]
    for n in names:
        if not _NAME_OK.match(n):
            raise SpecError(f"config name {n!r}: use letters, digits, '.', '_' or '-'")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"duplicate config name(s) {dupes}")
    return SweepSpec(name, str(data.get("description") or ""), base, configs, ref.name, thresholds, data,
                     _timing_repeats(data.get("timing")))  # fmt: skip


def _timing_repeats(data: Any) -> int:
    if data is None:
        return 0
    _check_keys("timing", data, TIMING_KEYS, "key")
    repeats = data.get("repeats", 0)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 0:
        raise SpecError(f"timing.repeats: {repeats!r} is not valid; expected an integer >= 0")
    return repeats


SAMPLE_KINDS = ("edit", "generate")


def _check_dataset(ds: Any) -> None:
    """A dataset URI, or `{sample: edit|generate, rows: N, size: PX, seed: S}` for a synthetic one
    written into the sweep directory (components.data.sample scenes / prompts)."""
    if isinstance(ds, str) and ds:
        return
    if isinstance(ds, dict):
        _check_keys("base.dataset", ds, SAMPLE_DATASET_KEYS, "key")
        if ds.get("sample") not in SAMPLE_KINDS:
            raise SpecError(f"base.dataset.sample: one of {list(SAMPLE_KINDS)}")
        if int(ds.get("rows", 4)) < 1:
            raise SpecError("base.dataset.rows must be >= 1")
        if "output_size" in ds:
            from components.data.datasets import parse_size

            try:
                parse_size(str(ds["output_size"]))
            except ValueError as exc:
                raise SpecError(f"base.dataset.output_size: {exc}") from None
        return
    raise SpecError("base.dataset: a URI or a mapping {sample: edit|generate, rows: N}")


def _find_reference(ref: Any, configs: list[SweepConfig]) -> SweepConfig:
    if ref is None:
        if len(configs) == 1:
            return configs[0]
        raise SpecError("reference: required when the sweep has more than one config")
    if isinstance(ref, str):
        for c in configs:
            if c.name == ref:
                return c
        raise SpecError(f"reference {ref!r}: no such config; have {[c.name for c in configs]}")
    if isinstance(ref, dict):
        hits = [c for c in configs if all(c.params.get(k) == v for k, v in ref.items())]
        if len(hits) != 1:
            raise SpecError(f"reference {ref}: matches {len(hits)} configs, need exactly one")
        return hits[0]
    raise SpecError("reference: a config name or a mapping of parameter values")


# The determinism floor: a re-run of the reference on the same machine must reproduce its pixels.
DETERMINISM_DEFAULT_GATE: dict[str, Any] = {"bitwise": True}


def _determinism_thresholds(value: Any) -> Thresholds | None:
    """`true`: gated, every row bitwise identical; a mapping: those thresholds instead (e.g.
    `{psnr_min: 60}` where kernels are not deterministic), `gate: false` inside it: not gated."""
    if value is True:
        return Thresholds.from_dict(DETERMINISM_DEFAULT_GATE)
    if not isinstance(value, dict):
        raise SpecError("precision_budget.determinism: true, false, or a mapping of thresholds")
    value = dict(value)
    if value.pop("gate", True) is False:
        return None
    th = _thresholds("precision_budget.determinism", value or DETERMINISM_DEFAULT_GATE)
    if not th.active:
        raise SpecError("precision_budget.determinism: no threshold left; use {gate: false} to show it ungated")
    return th


def _budget_configs(
    data: Any, ref: SweepConfig, thresholds: Thresholds, overrides: list[dict[str, Any]]
) -> list[SweepConfig]:
    """determinism (the reference re-run; gated: bitwise by default), reuse_drift (kv_reuse toggled,
    AR outputs taken from the reference run) and ar_diversity (another seed); the last two are not
    gated unless `gate: true`."""
    if data is None or data is False:
        return []
    if data is True:
        data = {}
    if not isinstance(data, dict):
        raise SpecError("precision_budget: expected true/false or a mapping")
    _check_keys("precision_budget", data, BUDGET_KEYS, "key")
    gate = bool(data.get("gate", False))
    th = thresholds if gate else None
    out: list[SweepConfig] = []
    if data.get("reuse_drift", True):
        reuse = not bool(ref.params.get("kv_reuse", True))
        out.append(
            SweepConfig(
                "reuse-drift", {**ref.params, "kv_reuse": reuse}, REUSE_DRIFT, ref.name, th,
                {"kv_reuse": reuse, "ar_tokens": "from reference"}, ar_from=ref.name,
            )
        )  # fmt: skip
    div = data.get("ar_diversity", True)
    if div:
        seed = ref.params.get("seed", 0)
        new_seed = div.get("seed") if isinstance(div, dict) and "seed" in div else int(seed or 0) + 1
        if new_seed == seed:
            raise SpecError("precision_budget.ar_diversity.seed must differ from the reference seed")
        out.append(
            SweepConfig(
                "ar-diversity", {**ref.params, "seed": new_seed}, AR_DIVERSITY, ref.name, th, {"seed": new_seed}
            )
        )
    if gate:
        for c in out:
            _apply_overrides(c, overrides)
    # The reference re-run goes last: its time, next to the reference's (run first), brackets the
    # whole sweep and so measures how much the machine's speed drifted meanwhile.
    determinism = data.get("determinism", True)
    if determinism is not False and determinism is not None:
        det = SweepConfig("determinism", dict(ref.params), DETERMINISM, ref.name, _determinism_thresholds(determinism),
                          {"rerun": "reference"})  # fmt: skip
        _apply_overrides(det, [o for o in overrides if o.get("name") == det.name])
        out.append(det)
    return out


def expanded_grid_text(spec: SweepSpec) -> str:
    rows = spec.grid_table()
    cols = ["name", "role", "vs", "varied", "ar_from", "gates"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines.append("  ".join("-" * widths[c] for c in cols))
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def load_spec(path: str | Path) -> SweepSpec:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: invalid YAML: {exc}") from exc
    spec = parse_spec(data)
    _resolve_dataset(spec, p.parent)
    return spec


def _resolve_dataset(spec: SweepSpec, spec_dir: Path) -> None:
    """A relative local dataset path is taken relative to the spec file when it exists there."""
    if not isinstance(spec.base["dataset"], str):
        return
    ds = str(spec.base["dataset"])
    if "://" in ds or Path(ds).is_absolute() or Path(ds).exists():
        return
    candidate = (spec_dir / ds).resolve()
    if candidate.exists():
        spec.base["dataset"] = str(candidate)
        for c in spec.configs:
            if c.params.get("dataset") == ds:
                c.params["dataset"] = str(candidate)
