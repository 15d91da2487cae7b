"""Where one AR decode step of the FP8 model spends its time, kernel by kernel, at the batch and K/V
lengths the continuous-batching scheduler runs (full-width layers, dummy weights, one GPU).

    python3 benchmarks/decode_profile.py --out $OUT/decode_profile.json

A `--layers`-layer FP8 stack (`engine.build_model_fp8`, the engine's dummy weights), a K/V pool of
`--rows` slots with `--span` capacity holding rows of mixed lengths (the pool of
benchmarks/decode_attention.py: half ~1.2k T2I prompts, half ~5.2k edit prompts, plus CoT; one slot
in six free), one static decode step (`StaticDecoder`, as the scheduler runs it): its CUDA-graph
replay timed (CUDA events), against the HBM floor (`decode_kernels.floor_bytes` at the live rows and
their mean length), under the kernel settings of ARDIT_KERNELS (e.g. `compile=off` for the layers
without their compiled regions); then a torch.profiler table of a few eager runs of the same step (the same
kernels without the graph), per layer, sorted by device time. Prints both; writes JSON and the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.decode_kernels import copy_bandwidth, floor_bytes  # noqa: E402
from benchmarks.engine_layers import cuda_time  # noqa: E402
from components.engine.config import get_config  # noqa: E402
from components.engine.engine import build_model_fp8  # noqa: E402
from components.engine.kernels import settings  # noqa: E402
from components.engine.kernels.decode import StaticDecoder  # noqa: E402


def kernel_rows(prof, per_layer: int) -> list[dict]:
    """A torch.profiler run's kernels, most device time first: name, microseconds and calls per layer."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return [{"name": e.key[:140], "us_per_layer": round(e.self_device_time_total / per_layer, 2),
             "calls_per_layer": round(e.count / per_layer, 2)} for e in events]


def report(result: dict, out: str, top: int = 40, kind: bool = False) -> None:
    """Print the result (without its kernels) and a table of its first `top` kernels; write it as JSON."""
    kernels = result["kernels"]
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}))
    print(f"{'us/layer':>9}{'calls':>7}  " + (f"{'kind':<22} " if kind else "") + "kernel")
    for k in kernels[:top]:
        print(f"{k['us_per_layer']:>9}{k['calls_per_layer']:>7}  " + (f"{k['kind']:<22} " if kind else "")
              + k["name"][:100])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


def pool_lengths(rows: int, span: int, seed: int = 0) -> list[int]:
    """Mixed row lengths of the scheduler's pool; 0 marks a free slot."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        prompt = 1200 if i % 2 else 5200
        out.append(0 if i % 6 == 5 else min(span - 1, prompt + int(torch.randint(30, 1500, (1,), generator=gen))))
    return out


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=42)
    p.add_argument("--span", type=int, default=7168)
    p.add_argument("--out", default="decode_profile.json")
    args = p.parse_args()

    cfg = get_config("hunyuan-image-3").replace(num_hidden_layers=args.layers)
    model = build_model_fp8(cfg, "cuda", seed=0)
    bandwidth = copy_bandwidth()
    lengths = pool_lengths(args.rows, args.span)
    live = [i for i, n in enumerate(lengths) if n]
    cache = model.new_cache(args.rows, args.span)
    valid = torch.zeros(args.rows, args.span, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, :n] = True
    for t in cache.k_rows + cache.v_rows:
        t.normal_()
    dec = StaticDecoder(model, cache, valid, [0] * args.rows, 0, graphs=True)
    tokens = [int(t) if n else None for t, n in zip(torch.randint(0, cfg.vocab_size, (args.rows,)), lengths)]
    # each live row writes its next slot; the step is idempotent, so replays repeat the same step
    with model.autocast():
        dec.step(tokens, lengths)  # captures the graph
        top = dec.set_inputs(tokens, lengths, args.rows)
        span = dec.span(top)
        graph_ms = cuda_time(lambda: dec.run(span, 0, args.rows), warmup=3, repeat=20)
        eager_ms = cuda_time(lambda: dec.forward(span, 0, args.rows), warmup=2, repeat=5)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        runs = 5
        with prof:
            for _ in range(runs):
                dec.forward(span, 0, args.rows)
            torch.cuda.synchronize()
    mean_kv = sum(lengths[i] for i in live) / len(live)
    floor_ms = args.layers * floor_bytes(model, len(live), int(mean_kv)) / bandwidth * 1e3
    kernels = kernel_rows(prof, runs * args.layers)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
              "settings": settings().describe(),
              "rows": args.rows, "live_rows": len(live), "span": span, "mean_kv": round(mean_kv, 1),
              "copy_bandwidth_TBps": round(bandwidth / 1e12, 2),
              "graph_ms_per_layer": round(graph_ms / args.layers, 4), "eager_ms_per_layer": round(eager_ms / args.layers, 4),
              "floor_ms_per_layer": round(floor_ms / args.layers, 4),
              "graph_pct_of_floor": round(100 * floor_ms / graph_ms, 1),
              "kernel_us_per_layer_total": round(sum(k["us_per_layer"] for k in kernels), 1), "kernels": kernels}
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
