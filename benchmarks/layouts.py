"""The product job on every GPU layout, through the job runner users run (`ardit edit`).

    python benchmarks/layouts.py --layouts tp1 tp2 pp2 dp2 --rows 32 --out $OUT/layouts.json
    python benchmarks/layouts.py --layers 4 --layouts tp1 tp2 pp2 --rows 8 --out $OUT/stack.json

Each layout runs `python -m pipeline.cli edit` as a user would, on the full-size model with dummy
weights (`--model hunyuan-image-3`, or with --layers N a checkpoint directory written here whose
config.json is the released one cut to N decoder layers: full width, reduced depth), FP8 by default,
IT2I rows with 1024x1024 conditioning images and outputs (--output-size), 8 steps, CFG 5, and every row's CoT forced to
--cot-tokens tokens (ARDIT_BENCH_COT_TOKENS, honoured with dummy weights only).

Per layout it reports: rows ok / failed (and the first failure), wall time, model load time,
img/GPU-h end to end and without the load (wall - load), seconds per row per stage (AR prefill,
AR decode, DiT; of the DiT its mean step, its prefix and its VAE decode), peak memory per GPU
(nvidia-smi, sampled every 0.5 s), kernel fallbacks, and each shard's step records (wall time,
the AR's pool and decode step, frames compiled and their seconds, GPU memory peaks and retries).
With --time-limit the job running at the limit is stopped as Ctrl-C would, and what it committed is
reported (`cut_by_time_limit`); --out is written after every layout.
Layout names: tpN, ppN, dpN and combinations joined by 'x' (e.g. pp2xtp2, dp2xtp1), with `:seq` or
`:ovl` appended for `--overlap off` / `on` (a shard's AR and DiT in turn, or at once on each model
copy; without a suffix the job's default, auto). GPU busy: the mean of nvidia-smi's utilization.gpu
sampled every 0.5 s over the job. `--cot-tokens` takes N or lognormal:MEDIAN:LO:HI (e.g.
lognormal:1000:200:2048, the realistic CoT lengths; see components/engine/ar.py ForcedCot).
For the full model at the default settings (IT2I 1024x1024, 8 steps, CFG 5) it also gives the
fraction of the physical bound of ~2 650 img/GPU-h (FP8 GEMMs at dense peak, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


PHYSICAL_BOUND_IMG_PER_GPU_H = 2650  # IT2I 1024x1024, 8 CFG steps, K/V reused, at dense FP8 peak (H100 / H200)
OVERLAP_SUFFIX = {"seq": "off", "ovl": "on"}


def parse_layout(name: str) -> dict[str, int]:
    """'pp2xtp2' -> {'tp': 2, 'pp': 2, 'dp': 1} (an `:seq` / `:ovl` suffix is the overlap arm)."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    name, _, arm = name.partition(":")
    if arm and arm not in OVERLAP_SUFFIX:
        raise SystemExit(f"layout suffix {arm!r}: use :seq or :ovl")
    for part in name.split("x"):
        m = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
        if not m:
            raise SystemExit(f"layout {name!r}: parts are tpN, ppN, dpN joined by 'x'")
        sizes[m.group(1)] = int(m.group(2))
    return sizes


class GpuMemory:
    """Peak memory.used and the utilization.gpu samples per GPU from nvidia-smi, in the background."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib, self._stop = interval_s, {}, threading.Event()
        self.busy: dict[int, list[int]] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu",
                                      "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                for line in out.strip().splitlines():
                    index, used, busy = (int(v) for v in line.split(","))
                    self.peak_mib[index] = max(self.peak_mib.get(index, 0), used)
                    self.busy.setdefault(index, []).append(busy)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval_s)

    def mean_busy(self) -> dict[int, float]:
        """Mean utilization.gpu (%) per GPU over the samples."""
        return {i: round(sum(v) / len(v), 1) for i, v in self.busy.items() if v}

    def __enter__(self) -> "GpuMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_reduced_checkpoint(directory: Path, layers: int, distil: bool = False) -> Path:
    """config.json of the released model cut to `layers` decoder layers, plus the files beside the
    weights (tokenizer, system prompts, generation config); weights are drawn (--dummy-weights)."""
    from components.engine.config import full_config, full_distil_config
    from components.engine.generation_config import GenerationConfig, write_generation_config_file
    from components.engine.system_prompts import write_system_prompt_file
    from components.engine.tokenizer import write_tokenizer_files

    config = (full_distil_config() if distil else full_config())
    n = layers
    config = config.replace(num_hidden_layers=n, moe_topk=config.moe_topk[:n],
                            moe_intermediate_size=config.moe_intermediate_size[:n],
                            num_shared_expert=config.num_shared_expert[:n])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    write_tokenizer_files(directory)
    write_system_prompt_file(directory)
    write_generation_config_file(directory, GenerationConfig.from_dict({
        "diff_infer_steps": 8, "diff_guidance_scale": 5.0, "flow_shift": 3.0, "bot_task": "think_recaption",
        "use_system_prompt": "en_unified", "sequence_template": "instruct", "max_new_tokens": 2048,
        "do_sample": True, "temperature": 0.6, "top_k": 1024, "top_p": 0.95, "drop_think": False,
        "max_length": 22800}))
    return directory


def rows_of(run_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(run_dir.glob("shards/*/rows.parquet")) for r in pq.read_table(f).to_pylist()]


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def job_processes(pgid: int) -> list[int]:
    """The PIDs of the job's process group that are ardit's own (the CLI and its ranks)."""
    out = subprocess.run(["ps", "-g", str(pgid), "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.strip().splitlines()
            if line.strip() and "compile_worker" not in line and "resource_tracker" not in line]


def watch_for_stall(proc: subprocess.Popen, last_line: list[float], stall_s: float) -> None:
    """If the job prints nothing for stall_s: every process of it prints its stacks (SIGUSR1,
    `ranks.dump_stacks_on_signal`), and after a few seconds the job is stopped."""
    import signal

    while proc.poll() is None:
        if time.monotonic() - last_line[0] > stall_s:
            print(f"\n[layouts] no output for {stall_s:.0f} s: dumping every process's stack, then stopping the job",
                  flush=True)
            for command in (["ps", "-g", str(proc.pid), "-o", "pid,stat,wchan:28,pcpu,etime,args"],
                            ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv"]):
                try:
                    print(subprocess.run(command, capture_output=True, text=True, timeout=20).stdout[:4000], flush=True)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            for pid in job_processes(proc.pid):  # not torch's compile workers: SIGUSR1 kills them
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(10)
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(10)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            return
        time.sleep(1)


def stop_at_deadline(proc: subprocess.Popen, deadline: float, cut: list[bool]) -> None:
    """At `deadline` (time.monotonic()) stop the job as Ctrl-C would (SIGINT to the CLI: it stops its
    ranks and says what it committed), then harder if it does not end. A device call's limit would
    otherwise kill the benchmark too, and with it every result not yet written."""
    import signal

    while proc.poll() is None:
        if time.monotonic() >= deadline:
            cut[0] = True
            print("\n[layouts] time limit reached: stopping the job (what it committed is still reported)", flush=True)
            for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 0)):
                try:
                    if sig == signal.SIGINT:
                        os.kill(proc.pid, sig)  # the CLI alone: it stops its ranks itself
                    else:
                        os.killpg(proc.pid, sig)
                except OSError:
                    return
                end = time.monotonic() + grace
                while proc.poll() is None and time.monotonic() < end:
                    time.sleep(0.5)
                if proc.poll() is not None:
                    return
            return
        time.sleep(1)


def run_layout(name: str, args: argparse.Namespace, dataset: Path, model: str, work: Path,
               deadline: float | None = None) -> dict:
    sizes = parse_layout(name)
    gpus = sizes["tp"] * sizes["pp"] * sizes["dp"]
    run_id = f"bench-{name.replace(':', '-')}"
    arm = name.partition(":")[2]
    shutil.rmtree(work / "runs" / run_id, ignore_errors=True)
    shards = max(args.shards, sizes["dp"])
    cmd = [sys.executable, "-m", "pipeline.cli", "edit", str(dataset), "-o", str(work / "runs"), "--run-id", run_id,
           "--model", model, "--num-shards", str(shards), "--steps", str(args.steps), "--guidance", str(args.guidance),
           "--device", args.device, "--tp", str(sizes["tp"]), "--pp", str(sizes["pp"]), "--dp", str(sizes["dp"])]
    cmd.append("--dummy-weights")  # presets draw random weights anyway; the forced CoT asks for it by name
    if args.quantization != "none":
        cmd += ["--quantization", args.quantization]
    if arm:
        cmd += ["--overlap", OVERLAP_SUFFIX[arm]]
    cmd += args.extra
    env = {**os.environ, "ARDIT_BENCH_COT_TOKENS": str(args.cot_tokens), "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    with GpuMemory() as memory:  # the job's output is shown as it comes (a run cut short still shows how far it got)
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own process group: the ranks get the stall signals
        last_line = [time.monotonic()]
        if args.stall_s:
            threading.Thread(target=watch_for_stall, args=(proc, last_line, args.stall_s), daemon=True).start()
        cut = [False]
        if deadline is not None:
            threading.Thread(target=stop_at_deadline, args=(proc, deadline, cut), daemon=True).start()
        for line in proc.stdout:
            last_line[0] = time.monotonic()
            lines.append(line)
            print(line, end="", flush=True)
        proc.wait()
    wall = time.perf_counter() - t0
    log = "".join(lines)[-4000:]
    run_dir = work / "runs" / run_id
    rows = rows_of(run_dir)
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") != "ok"]
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    elif (run_dir / "inputs" / "manifest.json").is_file():  # a job stopped early: its committed shards
        from components.summary.run import summarize
        from components.data.runs import RunLayout

        summary = summarize(RunLayout.open(str(work / "runs"), run_id))
    split = summary.get("time_split_s", {})
    load_s = split.get("load")
    checks_s, job_s = summary.get("checks_s"), summary.get("wall_s")
    start_s, close_s = summary.get("start_s"), summary.get("close_s")
    result = {
        "layout": name, **sizes, "gpus": gpus, "exit_code": proc.returncode, "cut_by_time_limit": cut[0],
        "rows": len(rows), "rows_ok": len(ok),
        "rows_failed": len(failed), "first_failure": failed[0].get("error") if failed else None,
        "wall_s": round(wall, 1), "load_s": load_s,
        # the job's own clock, and outside it: the CLI's start (imports), the checks, the ranks stopping
        # after the last commit, and the rest (the summary, the CLI's exit)
        "job_wall_s": job_s, "start_s": start_s, "checks_s": checks_s, "close_s": close_s,
        "outside_job_and_checks_s": round(wall - job_s - checks_s, 1) if job_s and checks_s else None,
        "outside_unaccounted_s": (round(wall - job_s - checks_s - start_s - close_s, 1)
                                  if None not in (job_s, checks_s, start_s, close_s) else None),
        "img_per_gpu_h": round(len(ok) * 3600 / (wall * gpus), 1) if ok else 0.0,
        "gpu_busy_pct": memory.mean_busy(),
        "shards_overlapped": summary.get("shards_overlapped"), "kv_stores": summary.get("kv_stores"),
        "img_per_gpu_h_after_load": (round(len(ok) * 3600 / ((wall - load_s) * gpus), 1)
                                     if ok and load_s else None),
        "ar_prefill_s_per_row": mean([r.get("ar_prefill_s") for r in ok]),
        "ar_decode_s_per_row": mean([r.get("ar_decode_s") for r in ok]),
        "dit_s_per_row": mean([(r.get("dit_total_s") or 0) + (r.get("vae_decode_s") or 0) for r in ok]),
        "dit_step_s_mean": mean([r.get("dit_step_s_mean") for r in ok]),
        # pipeline stages: the DiT group's time per row, by phase (prefixes, wavefront, VAE decodes)
        "dit_group_s_per_row": {phase: mean([r[f"dit_group_{phase}_s"] / r["dit_rows_in_flight"] for r in ok
                                             if r.get(f"dit_group_{phase}_s") is not None])
                                for phase in ("prepare", "denoise", "finish")},
        "dit_prefix_s_per_row": mean([r.get("dit_prefix_s") for r in ok]),
        "vae_decode_s_per_row": mean([r.get("vae_decode_s") for r in ok]),  # the row's image, after its steps
        "kv_paths": sorted({str(r.get("kv_path")) for r in ok}),
        "kernel_fallbacks": summary.get("kernel_fallbacks"),
        "ar_oom_retries": summary.get("ar_oom_retries"), "gpu_alloc_retries": summary.get("gpu_alloc_retries"),
        # each shard's steps: wall time, the AR scheduler's batch, phases and captures, GPU memory peaks
        "shard_steps": [{"shard": sh["shard"], **sh.get("steps", {})} for sh in summary.get("shards", [])],
        "peak_gpu_mib": memory.peak_mib, "time_split_s": split, "log_tail": log[-1500:],
    }
    if not args.layers and not args.model and (args.steps, args.guidance, args.image_size) == (8, 5.0, 1024):
        result["bound_fraction"] = round(result["img_per_gpu_h"] / PHYSICAL_BOUND_IMG_PER_GPU_H, 3)
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["tp1"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--cot-tokens", default="256", help="N, or lognormal:MEDIAN:LO:HI (ARDIT_BENCH_COT_TOKENS)")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--output-size", default="1024x1024",
                   help="the rows' size column: WxH, or auto (the ratio token decides; with dummy weights "
                        "it varies by row, and each new size compiles its DiT graphs)")
    p.add_argument("--quantization", default="fp8", help="fp8 | none")
    p.add_argument("--layers", type=int, default=0, help="reduced depth (0: the full 32-layer preset)")
    p.add_argument("--model", default=None, help="a preset or checkpoint instead (e.g. tiny); --layers is ignored")
    p.add_argument("--stall-s", type=float, default=0,
                   help="when the job prints nothing for this long: dump every rank's stack (SIGUSR1), then stop it")
    p.add_argument("--time-limit", type=float, default=0,
                   help="seconds for all layouts together (0: none); at the limit the running job is stopped as "
                        "Ctrl-C would and what it committed is reported (keep it under the device call's limit)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a check of this script with --model tiny")
    p.add_argument("--work", default="/tmp/ardit-layouts")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more `ardit edit` options (after --)")
    args = p.parse_args()

    from components.data.sample import write_sample_edit_dataset

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / f"edit-{args.rows}-{args.image_size}-{args.output_size}.parquet"
    if not dataset.exists():
        write_sample_edit_dataset(str(dataset), n=args.rows, size=args.image_size, output_size=args.output_size)
    model = args.model or (str(write_reduced_checkpoint(work / f"stack-{args.layers}", args.layers)) if args.layers
                           else "hunyuan-image-3")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = {"date": time.strftime("%Y-%m-%d"), "device": device,
               "gpus_visible": torch.cuda.device_count(), "torch": torch.__version__, "argv": sys.argv[1:],
               "layouts": []}
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    for name in args.layouts:
        if deadline is not None and time.monotonic() >= deadline:
            print(f"[layouts] time limit reached: {name} not run", flush=True)
            break
        results["layouts"].append(run_layout(name, args, dataset, model, work, deadline))
        if args.out:  # after each layout: a later one that is cut short loses nothing before it
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'layout':<12} {'ok':>4} {'fail':>4} {'wall s':>7} {'load s':>7} {'img/GPU-h':>9} {'w/o load':>9} "
          f"{'busy %':>7} {'AR pre':>7} {'AR dec':>7} {'DiT':>6} {'peak GiB/GPU':>14}")
    for r in results["layouts"]:
        peak = ",".join(f"{v / 1024:.0f}" for v in r["peak_gpu_mib"].values())
        busy = ",".join(f"{v:.0f}" for v in r["gpu_busy_pct"].values())
        print(f"{r['layout']:<12} {r['rows_ok']:>4} {r['rows_failed']:>4} {r['wall_s']:>7} {str(r['load_s']):>7} "
              f"{r['img_per_gpu_h']:>9} {str(r['img_per_gpu_h_after_load']):>9} {busy:>7} "
              f"{str(r['ar_prefill_s_per_row']):>7} {str(r['ar_decode_s_per_row']):>7} {str(r['dit_s_per_row']):>6} "
              f"{peak:>14}")
        print(f"  outside the job's clock: {r.get('outside_job_and_checks_s')} s besides the checks' "
              f"{r.get('checks_s')} s; of these the CLI's start {r.get('start_s')} s, the ranks stopping "
              f"{r.get('close_s')} s, the rest {r.get('outside_unaccounted_s')} s")
        for step in r["shard_steps"]:  # each shard's steps: where the time went, how close to memory's edge
            ar, dit = step.get("ar", {}), step.get("dit", {})
            if not ar and not dit:
                continue  # not committed (a job stopped early)
            sched = ar.get("scheduler", {})
            per_step = 1000 * sched["decode_s"] / sched["decode_steps"] if sched.get("decode_steps") else None
            kv_budget, outside = sched.get("kv_budget_bytes"), sched.get("outside_allocator_bytes")  # CUDA only
            budget = (f", K/V budget {kv_budget / 2**30:.2f} GiB ({outside / 2**30:.2f} GiB in use outside the "
                      "allocator)" if kv_budget is not None and outside is not None else "")
            print(f"  shard {step['shard']}: AR {ar.get('wall_s')} s (pool {sched.get('pool_rows')} rows{budget}, "
                  f"{sched.get('mean_batch')} a step, decode {per_step and round(per_step, 1)} ms a step, prefill "
                  f"{sched.get('prefill_s')} s, OOMs {sched.get('oom_retries')}, compiles {ar.get('compile')}, "
                  f"memory {ar.get('memory')}); DiT {dit.get('wall_s')} s (compiles {dit.get('compile')}, "
                  f"memory {dit.get('memory')}, handoff {dit.get('handoff')})")


if __name__ == "__main__":
    main()
