"""python -m components.ar --output URI --run-id ID --shard K [--model tiny] [--kv-store URL] ...
   python -m components.ar --config FILE_OR_JSON --shard K

The flags (or --config: a JobConfig's to_dict() JSON) make the step's JobConfig.
Generation settings left out (or passed empty) come from the model's generation config.
Exit codes: 0 ok, 2 configuration error (one line on stderr), 130 interrupted."""

from __future__ import annotations

import json
import sys

from components.options import BOT_TASKS, auto_or_int
from components.runtime.dispatch import run_step
from components.step_program import (
    StepArgumentParser,
    add_engine_args,
    optional_bool,
    optional_float,
    optional_int,
    optional_str,
    step_config,
    step_main,
)


def main(argv: list[str] | None = None) -> int:
    p = StepArgumentParser(prog="python -m components.ar", description=__doc__)
    add_engine_args(p)
    p.add_argument("--batch-size", type=auto_or_int, default="auto",
                   help="AR rows in flight: auto (sized to GPU memory; 8 on the CPU) or a hard cap (default auto)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory the AR step may fill with weights, K/V and activations (default 0.9)")
    p.add_argument("--max-num-batched-tokens", type=optional_int, default=None,
                   help="prompt tokens prefilled per scheduler step, between decode steps (default 2048)")
    p.add_argument("--bot-task", type=optional_str, default=None, choices=[None, *BOT_TASKS],
                   help="what the AR writes before the image (default: generation config)")
    p.add_argument("--system-prompt", type=optional_str, default=None,
                   help="en_unified, en_think_recaption, ..., none, dynamic, or the text (default: generation config)")
    p.add_argument("--max-new-tokens", type=optional_int, default=None,
                   help="CoT token budget per stage (default: generation config)")
    p.add_argument("--temperature", type=optional_float, default=None, help="0 = greedy (default: generation config)")
    p.add_argument("--top-k", type=optional_int, default=None, help="0 = off (default: generation config)")
    p.add_argument("--top-p", type=optional_float, default=None, help="(0, 1] (default: generation config)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0)")
    p.add_argument("--batch-invariant", nargs="?", const=True, default=False, type=optional_bool,
                   help="each row computed alone: its CoT and K/V are bitwise independent of its batch and shard "
                        "(slower decode; a run keeps the setting it started with)")
    args = p.parse_args(argv)

    def body() -> int:
        from components.ar.budget import kept_budget
        from components.ar.run import run as ar_run
        from components.progress import make_progress

        kwargs = {"config": step_config(p, args, argv), "shard": args.shard}
        with make_progress("auto") as progress:  # with --tensor-parallel-size N: N ranks, rank 0 writes
            result = run_step(ar_run, kwargs, progress, restart_from=kept_budget)
        print(json.dumps(result))
        return 0

    return step_main(p.prog, body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
