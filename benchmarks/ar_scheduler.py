"""The AR stage under a realistic CoT-length mix: static batches of 8 vs continuous batching.

    python benchmarks/ar_scheduler.py --out $OUT/ar_scheduler.json                 # GPU, full size, FP8
    python benchmarks/ar_scheduler.py --model tiny --device cpu --rows 16 --cot lognormal:12:3:40 \
        --image-size 64 --out /tmp/ar_scheduler.json                               # CPU check

Dummy weights, `--rows` rows (half IT2I with a `--image-size` conditioning image, half T2I),
think_recaption, each row's CoT length forced from a lognormal (ARDIT_BENCH_COT_TOKENS, median 300,
30-1500 tokens by default; a row's length comes from a hash of its id, the same in every arm).
Arms, each through the engine's AR call with the prompt K/V exported (as the AR step; the store put
is left out):

- static8: the rows in batches of 8, each through `Engine.generate_ar` (the scheduler, the 8 rows
  admitted at once): a batch decodes until its longest CoT ends, the next batch waits (the static
  batching the AR step ran before, in a loop of its own since removed);
- cont8: the scheduler (`ARGenerator.stream`) capped at 8 rows in flight;
- auto: the scheduler with `--batch-size auto` (rows in flight sized to `--gpu-memory-utilization`).

Per arm: rows/s, generated tokens/s, mean decode batch, peak GPU memory, and the decode HBM floor:
decode steps x layers x decode_kernels.floor_bytes(mean batch, mean K/V length) / measured copy
bandwidth, as a share of the arm's whole wall time (prefill included, so a lower bound) and of the
scheduler arms' decode steps alone (`%floor decode`: the steps' synchronized wall time, without the
prefill chunks and the finished rows' K/V export), and of the steps that replayed a CUDA graph
(`%floor replays`: without the steps that captured one, and compiled the layers on first use). `--profile-steps A:B` writes a torch.profiler
table of scheduler steps A..B. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _requests(n: int, image_size: int):
    from PIL import Image

    from components.data.sample import EDIT_INSTRUCTIONS, GENERATE_PROMPTS
    from components.engine import ARRequest

    rng = torch.Generator().manual_seed(0)
    pixels = (torch.rand(image_size, image_size, 3, generator=rng) * 255).to(torch.uint8).numpy()
    image = Image.fromarray(pixels)
    return [ARRequest(f"row{i:04d}", EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)], [image], seed=i,
                      bot_task="think_recaption") if i % 2 == 0 else
            ARRequest(f"row{i:04d}", GENERATE_PROMPTS[i % len(GENERATE_PROMPTS)], [], seed=i,
                      bot_task="think_recaption")
            for i in range(n)]


def _run_arm(engine, name: str, requests, sampling, args) -> dict:
    from components.engine.ar_scheduler import Admission

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    outputs, stats = [], {}
    _sync()
    t0 = time.perf_counter()
    if name == "static8":
        for start in range(0, len(requests), 8):
            batch = engine.generate_ar(requests[start:start + 8], sampling)
            for out in batch:
                out.prompt_kv = None  # handed to the store in the AR step
            outputs += batch
        steps = sum(max(o.timings["ar_decode_steps"] for o in outputs[s:s + 8]) for s in range(0, len(outputs), 8))
    else:
        cap = 8 if name == "cont8" else "auto"
        admission = Admission.for_model(engine.model, cap, args.gpu_memory_utilization, args.max_num_batched_tokens)

        def keep(request, out):
            if isinstance(out, BaseException):
                raise out
            out.prompt_kv = None
            outputs.append(out)

        from components.engine import ar_scheduler

        if args.profile_steps:
            ar_scheduler.fault_hook = StepProfiler(args.profile_steps, Path(args.out).with_name(f"profile_{name}.txt"))
        try:
            stats = engine.ar.stream(requests, keep, sampling, True, admission)
        finally:
            ar_scheduler.fault_hook = None
        steps = stats["decode_steps"]
    _sync()
    wall = time.perf_counter() - t0
    generated = sum(len(o.generated_ids) for o in outputs)
    prompt = sum(len(o.prompt_ids) for o in outputs)
    mean_batch = generated / steps if steps else 0.0
    res = {"rows": len(outputs), "wall_s": round(wall, 2), "rows_per_s": round(len(outputs) / wall, 3),
           "generated_tokens": generated, "tokens_per_s": round(generated / wall, 1), "decode_steps": steps,
           "mean_batch": round(mean_batch, 2), "mean_prompt_tokens": round(prompt / len(outputs), 1),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None,
           "scheduler": {k: v for k, v in stats.items() if k != "events"}, "events": stats.get("events", [])}
    if torch.cuda.is_available() and steps:
        from benchmarks.decode_kernels import copy_bandwidth, floor_bytes

        kv = int(prompt / len(outputs) + generated / len(outputs) / 2)  # mean K/V length over a row's decode
        layers = len(engine.model.model.layers)
        floor_s = steps * layers * floor_bytes(engine.model, max(1, round(mean_batch)), kv) / args.bandwidth
        res.update(floor_s=round(floor_s, 2), pct_of_hbm_floor=round(100 * floor_s / wall, 1), floor_kv=kv)
        steps_s = stats.get("decode_s", 0.0) - stats.get("finish_s", 0.0)  # the decode steps alone
        if steps_s > 0:
            # and those that replayed a graph (a step that captured one also compiled and ran it twice)
            replays = steps - stats.get("capture_steps", 0)
            replay_s = steps_s - stats.get("capture_s", 0.0)
            res.update(decode_steps_s=round(steps_s, 2), ms_per_decode_step=round(1e3 * steps_s / steps, 2),
                       floor_ms_per_step=round(1e3 * floor_s / steps, 2),
                       pct_of_hbm_floor_decode=round(100 * floor_s / steps_s, 1),
                       capture_steps=stats.get("capture_steps", 0), capture_s=round(stats.get("capture_s", 0.0), 2),
                       ms_per_replay_step=round(1e3 * replay_s / replays, 2),
                       pct_of_hbm_floor_replay=round(100 * (floor_s * replays / steps) / replay_s, 1))
    return res


class StepProfiler:
    """torch.profiler over scheduler steps [first, last) of one arm (through the scheduler's
    per-step hook): the kernels a decode step spends its time in, as a table in `path`."""

    def __init__(self, spec: str, path: Path) -> None:
        self.first, self.last = (int(x) for x in spec.split(":"))
        self.path, self.step, self.prof = path, 0, None

    def __call__(self, scheduler) -> None:
        if self.step == self.first:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.rows = len(scheduler.running)
        elif self.step == self.last and self.prof is not None:
            _sync()
            self.prof.__exit__(None, None, None)
            averages = self.prof.key_averages()
            head = (f"scheduler steps {self.first}..{self.last}, {self.rows} rows decoding at the start, "
                    f"{scheduler.stats.decode_steps} decode steps so far\n")
            tables = [averages.table(sort_by=key, row_limit=45) for key in ("self_device_time_total",
                                                                             "device_time_total")]
            self.path.write_text(head + "\n\n".join(tables))
            print(f"profile of steps {self.first}..{self.last} written to {self.path}", flush=True)
            self.prof = None
        self.step += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hunyuan-image-3")
    p.add_argument("--quantization", default="fp8", help="fp8 | none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--cot", default="lognormal:300:30:1500", help="ARDIT_BENCH_COT_TOKENS")
    p.add_argument("--arms", default="static8,cont8,auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--profile-steps", default="", help="A:B: profile scheduler steps A..B of the scheduler arms")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ar_scheduler.json"))
    args = p.parse_args()

    from components.engine import Engine, SamplingParams
    from components.engine.ar import ForcedCot

    os.environ[ForcedCot.ENV] = args.cot  # as the AR step reads it (dummy weights only)
    forced = ForcedCot(args.cot)
    quant = None if args.quantization in ("", "none") or args.model == "tiny" else args.quantization
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    t0 = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, quantization=quant, dtype=dtype)
    _sync()
    engine.ar.forced_cot = forced
    requests = _requests(args.rows, args.image_size)
    sampling = SamplingParams(max_new_tokens=forced.hi + 32)  # the length ends each CoT, not the budget
    result = {"model": args.model, "quantization": quant or dtype, "device": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "rows": args.rows,
              "cot": args.cot, "image_size": args.image_size, "load_s": round(time.perf_counter() - t0, 1),
              "cot_lengths": sorted(forced.length(r.id) for r in requests), "arms": {}}
    result["cot_median"] = result["cot_lengths"][len(requests) // 2]
    if torch.cuda.is_available():
        from benchmarks.decode_kernels import copy_bandwidth

        args.bandwidth = copy_bandwidth()
        result["copy_bandwidth_TBps"] = round(args.bandwidth / 1e12, 2)
        result["weights_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    print(f"loaded in {result['load_s']} s; {args.rows} rows, CoT {args.cot} (median {result['cot_median']})",
          flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for arm in args.arms.split(","):
        result["arms"][arm] = _run_arm(engine, arm, requests, sampling, args)
        print(f"{arm}: {result['arms'][arm]}", flush=True)

    base = result["arms"].get("static8")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{'arm':8}{'rows/s':>9}{'tok/s':>10}{'x static8':>10}{'batch':>7}{'peak GB':>9}{'%floor':>8}"
          f"{'ms/step':>9}{'%floor decode':>15}{'%floor replays':>16}")
    for arm, r in result["arms"].items():
        speedup = r["rows_per_s"] / base["rows_per_s"] if base else float("nan")
        print(f"{arm:8}{r['rows_per_s']:>9}{r['tokens_per_s']:>10}{speedup:>10.2f}{r['mean_batch']:>7}"
              f"{r['peak_gb'] or 0:>9}{r.get('pct_of_hbm_floor', '-'):>8}{r.get('ms_per_decode_step', '-'):>9}"
              f"{r.get('pct_of_hbm_floor_decode', '-'):>15}{r.get('pct_of_hbm_floor_replay', '-'):>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
