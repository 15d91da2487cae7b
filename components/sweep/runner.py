"""Run every config of a sweep, evaluate each against its baseline, write the tables and report.

Layout of one sweep, `{output}/{sweep_id}/`:
```
spec.yaml              the spec as given
sweep.json             expanded configs, per-config run status, verdict
runs/{config}/...      one ordinary run per config (run layout), plus metrics.parquet from evaluation
sweep.parquet          one row per config: aggregates, thresholds, pass/fail
rows.parquet           one row per (config, row id): all row metrics
budget.parquet         the precision budget
report.html            the self-contained report
```
Jobs run through the `runner` argument (pipeline/sweep.py passes `pipeline.local.run_job`; tests
pass synthetic ones): components never import pipeline.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from components.evaluate.gates import FAIL, INFO, PASS, REF, config_verdict, fmt_db, records_to_table
from components.evaluate.metrics import OK, SIZE_MISMATCH
from components.evaluate.run import evaluate_run
from components.evaluate.runio import load_run_rows
from components.sweep.budget import compute_budget
from components.sweep.resume import (
    ResumeError,
    config_settings,
    describe_change,
    existing_runs,
    fingerprint,
    move_aside,
    read_settings,
    write_settings,
)
from components.sweep.spec import DETERMINISM, REFERENCE, SweepConfig, SweepSpec
from components.sweep.timing import noise_line, timing_summary

# Job keyword that makes a run take its AR outputs (and KV) from another run of the same output.
AR_FROM_PARAM = "ar_from_run"


@dataclass
class JobOutcome:
    result: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ar_pinned: bool = False


# Runs one config: (params, output root, run id, run to take the AR outputs from) -> outcome.
# The sweep does not know how jobs run; pipeline/sweep.py passes `pipeline.local.run_job` wrapped.
JobRunner = Callable[[dict[str, Any], Path, str, "str | None"], JobOutcome]


@dataclass
class SweepResult:
    sweep_dir: Path
    passed: bool
    configs: list[dict[str, Any]]
    failures: list[str]
    report: Path | None
    verdict_line: str = ""


def default_sweep_id(spec: SweepSpec) -> str:
    return f"{spec.name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def _run_done(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def run_sweep(
    spec: SweepSpec,
    output: str | Path,
    sweep_id: str | None = None,
    *,
    runner: JobRunner,
    resume: bool = False,
    report: bool = True,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Run, evaluate, tabulate and report a sweep.

    `resume` keeps configs whose run finished with the settings the spec gives now, continues
    unfinished ones, and reruns changed ones (the old run moves to `replaced/`). Without it, a sweep
    directory that already holds runs is refused (ResumeError) before anything runs."""
    sweep_id = sweep_id or default_sweep_id(spec)
    sweep_dir = Path(output) / sweep_id
    runs = sweep_dir / "runs"
    names = [c.name for c in spec.configs]
    if not resume and runs.is_dir() and existing_runs(runs, names):
        raise ResumeError(
            f"sweep {sweep_id} already has runs in {runs} ({', '.join(existing_runs(runs, names))}): "
            "add --resume to continue it (changed configs rerun) or choose another --sweep-id"
        )
    runs.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "spec.yaml").write_text(yaml.safe_dump(spec.raw, sort_keys=False))
    dataset = materialize_dataset(spec.base["dataset"], sweep_dir)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    previous: dict[str, Any] = {}
    if resume and (sweep_dir / "sweep.json").is_file():
        previous = json.loads((sweep_dir / "sweep.json").read_text()).get("states", {})
    job = _Pass(runner, dataset, sweep_dir, log)
    states = job.run(spec.configs, runs, resume, previous)
    repeat_times = _timing_rounds(spec, job, states)

    config_records, row_records = evaluate_sweep(spec, runs, states, log, dataset=dataset)
    timing = _timing(spec, config_records, repeat_times)
    log(noise_line(timing))
    budget = compute_budget(spec.configs, config_records, row_records)
    failures = sweep_failures(config_records)
    passed = not failures

    pq.write_table(records_to_table([_flat(r) for r in config_records]), sweep_dir / "sweep.parquet")
    pq.write_table(records_to_table(row_records) if row_records else pa.table({}), sweep_dir / "rows.parquet")
    pq.write_table(records_to_table(budget) if budget else pa.table({}), sweep_dir / "budget.parquet")
    meta = {
        "sweep_id": sweep_id,
        "name": spec.name,
        "description": spec.description,
        "reference": spec.reference,
        "base": spec.base,
        "dataset": dataset,
        "thresholds": spec.thresholds.as_dict(),
        "configs": [c.to_dict() for c in spec.configs],
        "states": states,
        "started": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "timing": {"repeats": spec.timing_repeats, **timing},
        "passed": passed,
        "verdict_line": verdict_line(config_records),
        "failures": failures,
    }
    (sweep_dir / "sweep.json").write_text(json.dumps(meta, indent=2, default=str))

    report_path = None
    if report:
        from components.report.render import write_report

        report_path = write_report(sweep_dir)
        log(f"report: {report_path}")
    return SweepResult(sweep_dir, passed, config_records, failures, report_path, meta["verdict_line"])


class _Pass:
    """Runs a list of configs into one output root (the sweep's runs/, or a timing round's)."""

    def __init__(self, runner: JobRunner, dataset: str, sweep_dir: Path, log: Callable[[str], None]) -> None:
        self.runner, self.dataset, self.sweep_dir, self.log = runner, dataset, sweep_dir, log

    def run(
        self, configs: list[SweepConfig], root: Path, resume: bool, previous: dict[str, Any], round_no: int = 0
    ) -> dict[str, dict[str, Any]]:
        """round_no > 0: a timing round (its log lines and replaced runs say so)."""
        root.mkdir(parents=True, exist_ok=True)
        log = self.log
        states: dict[str, dict[str, Any]] = {}
        fingerprints: dict[str, str] = {}
        for cfg in configs:
            settings = config_settings(cfg, fingerprints)
            fp = fingerprints[cfg.name] = fingerprint(settings)
            state: dict[str, Any] = {"run_error": "", "notes": [], "wall_s": None, "ar_pinned": False,
                                     "skipped": False, "fingerprint": fp, "settings": settings}  # fmt: skip
            states[cfg.name] = state
            name = f"timing round {round_no}: {cfg.name}" if round_no else cfg.name
            if cfg.ar_from and states.get(cfg.ar_from, {}).get("run_error"):
                state["run_error"] = f"not run: {cfg.ar_from} failed"
                continue
            if resume and existing_runs(root, [cfg.name]):
                recorded = read_settings(root, cfg.name)
                if recorded is None or recorded.get("fingerprint") != fp:
                    change = describe_change(recorded, settings)
                    old_fp = (recorded or {}).get("fingerprint")
                    moved = move_aside(self.sweep_dir, root, cfg.name, old_fp, f"timing-round{round_no}" if round_no else "")
                    state["notes"].append(f"rerun: settings changed ({change})")
                    log(f"[{name}] settings changed since its run ({change}): rerunning; "
                        f"old run moved to {moved.relative_to(self.sweep_dir)}")  # fmt: skip
                elif _run_done(root / cfg.name):
                    before = previous.get(cfg.name, {})
                    state["ar_pinned"] = bool(before.get("ar_pinned", False))
                    state["wall_s"] = before.get("wall_s")
                    state["notes"] = [n for n in before.get("notes", []) if not n.startswith("resumed")]
                    state["skipped"] = True
                    state["notes"].append("resumed: existing run kept (same settings)")
                    log(f"[{name}] already finished with the same settings, kept")
                    continue
            write_settings(root, cfg.name, settings, fp)
            log(f"[{name}] running ({cfg.label()})")
            t0 = time.perf_counter()
            try:
                outcome = self.runner({**cfg.params, "dataset": self.dataset}, root, cfg.name, cfg.ar_from)
                state["notes"] += outcome.notes
                state["ar_pinned"] = outcome.ar_pinned
            except Exception as exc:  # noqa: BLE001  (a failed config fails the sweep; the others still run)
                state["run_error"] = _one_line(exc)
                (root / f"{cfg.name}.error.txt").write_text(traceback.format_exc())
                log(f"[{name}] FAIL: {state['run_error']} (traceback: {root / cfg.name}.error.txt)")
            state["wall_s"] = time.perf_counter() - t0
        return states


TIMING_DIR = "timing"


def _timing_rounds(spec: SweepSpec, job: _Pass, states: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """`timing.repeats` more rounds over every config that ran (round-robin, so a drifting machine
    touches all alike) into timing/round{k}/; returns config -> the rounds' seconds per image."""
    times: dict[str, list[float]] = {}
    timed = [c for c in spec.configs if c.role != DETERMINISM and not states[c.name]["run_error"]]
    for k in range(1, spec.timing_repeats + 1):
        root = job.sweep_dir / TIMING_DIR / f"round{k}"
        round_states = job.run(timed, root, True, {}, round_no=k)
        for cfg in timed:
            if not round_states[cfg.name]["run_error"]:
                t = _run_time_per_image(root / cfg.name)
                if t is not None:
                    times.setdefault(cfg.name, []).append(t)
    return times


def _run_time_per_image(run: Path) -> float | None:
    try:
        values = [t for r in load_run_rows(run).values() if (t := r.time_per_image_s()) is not None]
    except (FileNotFoundError, ValueError):
        return None
    return sum(values) / len(values) if values else None


def _timing(
    spec: SweepSpec, config_records: list[dict[str, Any]], repeat_times: dict[str, list[float]]
) -> dict[str, Any]:
    """Timing samples per config (its run, the repeat rounds, and for the reference its determinism
    re-run) -> noise and ratios; the records gain time_per_image_s_median / _spread / speedup columns."""
    main = {r["config"]: r.get("time_per_image_s_mean") for r in config_records if not r.get("run_error")}
    samples: dict[str, list[float]] = {}
    for cfg in spec.configs:
        if cfg.role == DETERMINISM:
            continue
        samples[cfg.name] = [t for t in [main.get(cfg.name), *repeat_times.get(cfg.name, [])] if t is not None]
    for cfg in spec.configs:
        if cfg.role == DETERMINISM and main.get(cfg.name) is not None and cfg.baseline in samples:
            samples[cfg.baseline].append(main[cfg.name])  # the same job as the reference, run last
    summary = timing_summary(samples, spec.reference)
    for rec in config_records:
        t = summary["configs"].get(rec["config"])
        if t is None:  # the determinism re-run: its time is one of the reference's samples
            rec.update(time_per_image_s_median=main.get(rec["config"]), speedup_reliable=False,
                       speedup_note="a re-run of the reference: one of its timing samples")  # fmt: skip
            continue
        rec.update(time_samples=t["samples"], time_per_image_s_median=t["median"], time_spread=t["spread"],
                   speedup_vs_ref=t["speedup"], speedup_reliable=t["speedup_reliable"], speedup_note=t["speedup_note"])  # fmt: skip
    return summary


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def materialize_dataset(ds: str | dict[str, Any], sweep_dir: Path) -> str:
    """The dataset URI to run: as given, or a synthetic sample written to `{sweep_dir}/dataset/`.

    Sample rows carry no per-row seed, so the job's `seed` parameter decides the sampling."""
    if isinstance(ds, str):
        return ds
    import random

    from components.data.sample import EDIT_INSTRUCTIONS, GENERATE_PROMPTS, draw_scene

    kind, n, size = ds["sample"], int(ds.get("rows", 4)), int(ds.get("size", 64))
    output_size = str(ds["output_size"]) if "output_size" in ds else None  # pinned: one shape for every config
    if ds.get("targets"):  # procedural scenes with their exact targets: the semantic judge scores the runs
        from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset

        path = sweep_dir / "dataset" / f"sample-{kind}-targets.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "edit":
            return write_sample_edit_dataset(str(path), n=n, size=size, seed=int(ds.get("seed", 0)), targets=True,
                                             output_size=output_size or "auto")
        return write_sample_generate_dataset(str(path), n=n, seed=int(ds.get("seed", 0)), targets=True,
                                             size=output_size or "auto")
    rng = random.Random(int(ds.get("seed", 0)))
    if kind == "edit":
        table = pa.table({
            "id": [f"edit-{i:04d}" for i in range(n)],
            "instruction": [EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)] for i in range(n)],
            "image": pa.array([draw_scene(size, rng) for _ in range(n)], pa.binary()),
            **({"size": [output_size] * n} if output_size else {}),
        })  # fmt: skip
    else:
        table = pa.table({
            "id": [f"gen-{i:04d}" for i in range(n)],
            "prompt": [GENERATE_PROMPTS[i % len(GENERATE_PROMPTS)] for i in range(n)],
            "size": [output_size or f"{size}x{size}"] * n,
        })  # fmt: skip
    path = sweep_dir / "dataset" / f"sample-{kind}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def evaluate_sweep(
    spec: SweepSpec, runs: Path, states: dict[str, dict[str, Any]], log: Callable[[str], None] = print,
    dataset: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Evaluate each config against its baseline (the reference against itself, ungated), and, when
    the dataset carries targets, with the semantic judge (pass rate and PSNR against the targets)."""
    judged = dataset is not None and Path(dataset).is_file() and "target" in pq.read_schema(dataset).names
    config_records: list[dict[str, Any]] = []
    row_records: list[dict[str, Any]] = []
    for cfg in spec.configs:
        st = states[cfg.name]
        rec: dict[str, Any] = {
            "config": cfg.name,
            "role": cfg.role,
            "baseline": cfg.baseline or cfg.name,
            "label": cfg.label(),
            "params": json.dumps(cfg.params, default=str),
            "varied": json.dumps(cfg.varied, default=str),
            "gated": cfg.gated,
            "thresholds": json.dumps(cfg.thresholds.as_dict()) if cfg.thresholds else None,
            "run_error": st["run_error"],
            "eval_error": "",
            "fingerprint": st.get("fingerprint"),
            "wall_s": st["wall_s"],
            "ar_pinned": st["ar_pinned"],
            "notes": "; ".join(st["notes"]),
        }
        baseline = cfg.baseline or cfg.name
        if st["run_error"] or states.get(baseline, {}).get("run_error"):
            rec["passed"] = False
            rec["verdict"] = FAIL
            rec["violations"] = [st["run_error"] or f"baseline {baseline} failed"]
            config_records.append(rec)
            continue
        try:
            rows, summary = evaluate_run(runs, baseline, cfg.name, cfg.thresholds if cfg.gated else None)
        except (FileNotFoundError, ValueError) as exc:
            rec["eval_error"] = str(exc)
            rec["passed"] = False
            rec["verdict"] = FAIL
            rec["violations"] = [f"evaluation failed: {exc}"]
            config_records.append(rec)
            log(f"[{cfg.name}] evaluation FAILED: {exc}")
            continue
        summary.pop("run", None)
        summary.pop("ref_run", None)
        summary.pop("thresholds", None)
        rec.update(summary)
        if not cfg.gated:
            # Ungated configs still fail when rows are missing, failed or have no image; a size
            # change is an observed difference there (e.g. another seed picks another ratio).
            rec["violations"] = [
                f"{r['id']}: {r['eval_status']}: {r['eval_error']}"
                for r in rows
                if r["eval_status"] not in (OK, SIZE_MISMATCH)
            ]
            rec["passed"] = not rec["violations"]
        if judged:
            _judge(rec, dataset, runs / cfg.name, cfg)
        for r in rows:
            r["config"] = cfg.name
            r["role"] = cfg.role
        row_records += rows
        rec["verdict"] = config_verdict(rec["passed"], cfg.gated, cfg.role == REFERENCE)
        config_records.append(rec)
        gates = cfg.thresholds.describe() if cfg.gated else "not gated"
        against = "" if rec["verdict"] == REF else f" vs {baseline} ({gates})"
        log(
            f"[{cfg.name}] {rec['verdict']}{against}: {rec['rows_compared']}/{rec['rows']} rows compared, "
            f"PSNR min {fmt_db(rec['psnr_min'])} dB, bitwise {rec['bitwise_rows']}/{rec['rows']}"
            + (f"; judge pass {rec['judge_pass_rate']:.0%}, {fmt_db(rec['judge_psnr'])} dB vs targets"
               if "judge_pass_rate" in rec else "")
        )
    return config_records, row_records


def _judge(rec: dict[str, Any], dataset: str, run: Path, cfg: Any) -> None:
    """The semantic judge's pass rate and mean PSNR against the targets; a gated config under
    `judge_pass_min` fails."""
    from components.evaluate.judge import judge_run

    results, summary = judge_run(dataset, str(run))
    rate = summary["passed"] / len(results) if results else 0.0  # a row without an image fails
    rec["judge_pass_rate"], rec["judge_psnr"] = rate, summary["mean_psnr"]
    th = cfg.thresholds
    if cfg.gated and th is not None and th.judge_pass_min is not None and rate < th.judge_pass_min:
        rec["violations"] = [*rec.get("violations", []), f"judge pass {rate:.0%} < {th.judge_pass_min:.0%}"]
        rec["passed"] = False


def verdict_line(config_records: list[dict[str, Any]]) -> str:
    """The sweep's verdict in the words the report uses: PASS or FAIL, gated configs passing, INFO."""
    verdicts = {r["config"]: r.get("verdict", FAIL) for r in config_records}
    failed = [n for n, v in verdicts.items() if v == FAIL]
    gated = [r for r in config_records if r.get("gated")]
    passing = sum(1 for r in gated if verdicts[r["config"]] == PASS)
    info = sum(1 for v in verdicts.values() if v == INFO)
    head = f"FAIL: {len(failed)} config(s) fail ({', '.join(failed)})" if failed else "PASS"
    return f"{head} · {passing}/{len(gated)} gated configs pass · {info} INFO (not gated)"


def sweep_failures(config_records: list[dict[str, Any]]) -> list[str]:
    """Why the sweep fails: any config with a failed run/evaluation, or a gated config over its
    thresholds. The reference fails the sweep when its own rows failed."""
    out = []
    for r in config_records:
        if not r.get("passed", False):
            reasons = r.get("violations") or ["failed"]
            shown = "; ".join(reasons[:3]) + (f" (+{len(reasons) - 3} more)" if len(reasons) > 3 else "")
            bad_rows = len({v.split(":")[0] for v in reasons}) if r.get("rows") else 0
            prefix = f"{bad_rows}/{r['rows']} rows fail: " if bad_rows and not r.get("run_error") else ""
            out.append(f"{r['config']}: {prefix}{shown}")
    return out


def _flat(rec: dict[str, Any]) -> dict[str, Any]:
    out = dict(rec)
    out["violations"] = list(out.get("violations") or [])
    return out


__all__ = [
    "ResumeError",
    "AR_FROM_PARAM",
    "REFERENCE",
    "JobOutcome",
    "JobRunner",
    "SweepConfig",
    "SweepResult",
    "run_sweep",
    "sweep_failures",
]
