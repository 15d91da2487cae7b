"""The AR scheduler at 2 pipeline stages on the CPU (gloo): row groups in turn vs one group.

    python benchmarks/ar_row_groups_cpu.py --rows 16 --cot-tokens 48 --out bench.json
    python benchmarks/ar_row_groups_cpu.py --rows 16 --cot-tokens 48 --edit   # half edit rows: longer prompts

With one row group (`ARDIT_KERNELS=stage_row_groups=off`, the schedule before row groups) every decode step
and prefill chunk goes through stage 0, then stage 1, so each stage waits half the time. With a
group per stage (the default) stage 0 works on one group's step while stage 1 works on the other's,
and prompt chunks go on without waiting for the last stage. This shows the schedule on two CPU
processes of one core each (a model wide enough that the layers, not gloo, take the time); the GPU
numbers are benchmarks/layouts.py's (`--layouts pp2`).

Per arm: wall time of the AR over all rows (rank 0), decode steps, mean rows a step, and whether
every row's tokens equal the other arm's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_checkpoint(directory: Path, hidden: int, layers: int) -> Path:
    """The tiny preset widened to `hidden` and `layers` (weights drawn: --dummy-weights), with the
    files beside the weights."""
    from components.engine.config import tiny_config
    from components.engine.generation_config import GenerationConfig, write_generation_config_file
    from components.engine.system_prompts import write_system_prompt_file
    from components.engine.tokenizer import write_tokenizer_files

    config = tiny_config().replace(
        hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, attention_head_dim=hidden // 8, num_experts=8, moe_topk=[2] * layers,
        moe_intermediate_size=[hidden] * layers, num_shared_expert=[1] * layers)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    write_tokenizer_files(directory)
    write_system_prompt_file(directory)
    write_generation_config_file(directory, GenerationConfig.from_dict({
        "bot_task": "think_recaption", "use_system_prompt": "en_unified", "sequence_template": "instruct",
        "max_new_tokens": 256, "do_sample": False}))
    return directory


def run_rank(checkpoint: str, rows: int, cot_tokens: int, row_groups: str, edit: bool, device: str,
             parallel) -> dict:
    """On every stage: the AR over `rows` rows (T2I, or with `edit` every other one an edit row with a
    conditioning image: longer prompts), each CoT forced to `cot_tokens` tokens."""
    from components.engine import ARRequest, Engine, SamplingParams, kernels
    from components.engine.ar import ForcedCot
    from components.engine.ar_scheduler import Admission

    kernels.configure(stage_row_groups=row_groups)
    engine = Engine.load(checkpoint, dummy_weights=True, device=device, pipeline_parallel_size=parallel.pp_size,
                         parallel=parallel)
    engine.ar.forced_cot = ForcedCot(str(cot_tokens))
    prompts = ["a cat on a sofa", "a lighthouse at night in a storm", "two birds", "a bowl of fruit on a table"]
    image = None
    if edit:
        import numpy as np
        from PIL import Image

        image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    requests = [ARRequest(f"r{i}", prompts[i % len(prompts)], [image] if edit and i % 2 == 0 else [],
                          bot_task="think_recaption", seed=i) for i in range(rows)]
    results: dict = {}
    t0 = time.perf_counter()
    stats = engine.ar.stream(requests, lambda req, out: results.__setitem__(req.id, out.generated_ids),
                             SamplingParams(temperature=0, max_new_tokens=cot_tokens + 16),
                             admission=Admission(max_rows=rows))
    return {"wall_s": time.perf_counter() - t0, "tokens": results, "stats": stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--cot-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--edit", action="store_true", help="every other row an edit row (a 256x256 image)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from components.runtime.ranks import RankPool

    report = {"rows": args.rows, "cot_tokens": args.cot_tokens, "hidden": args.hidden, "layers": args.layers,
              "edit": args.edit, "arms": {}}
    with tempfile.TemporaryDirectory() as work:
        checkpoint = str(write_checkpoint(Path(work) / "wide-tiny", args.hidden, args.layers))
        for name, groups in (("one group (before)", "off"), ("a group per stage", "auto")):
            with RankPool(1, "cpu", pipeline_parallel_size=2, cpu_threads=1) as pool:
                got = pool.run(run_rank,
                               dict(checkpoint=checkpoint, rows=args.rows, cot_tokens=args.cot_tokens,
                                    row_groups=groups, edit=args.edit))
            stats = got["stats"]
            report["arms"][name] = {"wall_s": round(got["wall_s"], 2), "row_groups": stats["row_groups"],
                                    "decode_steps": stats["decode_steps"], "mean_batch": stats["mean_batch"],
                                    "prefill_tokens": stats["prefill_tokens"],
                                    "peak_steps_in_flight": stats["peak_steps_in_flight"], "tokens": got["tokens"]}
            print(f"{name:20s} wall {got['wall_s']:7.2f} s  groups {stats['row_groups']}  "
                  f"decode steps {stats['decode_steps']}  mean rows a step {stats['mean_batch']}", flush=True)
    before, after = report["arms"].values()
    report["same_tokens"] = before["tokens"] == after["tokens"]
    report["speedup"] = round(before["wall_s"] / after["wall_s"], 3)
    print(f"same tokens: {report['same_tokens']}   speed-up: {report['speedup']}x")
    if args.out:
        for arm in report["arms"].values():
            arm.pop("tokens")
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
