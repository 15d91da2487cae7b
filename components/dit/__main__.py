"""python -m components.dit --output URI --run-id ID --shard K [--model tiny] [--kv-store URL] [--steps N --guidance G]
   python -m components.dit --config FILE_OR_JSON --shard K [--no-prefetch] [--cfg-parallel]

The flags (or --config: a JobConfig's to_dict() JSON) make the step's JobConfig.
Generation settings left out (or passed empty) come from the model's generation config.
Exit codes: 0 ok, 2 configuration error (one line on stderr), 130 interrupted."""

from __future__ import annotations

import json
import sys

from components.runtime.dispatch import run_step
from components.step_program import (
    StepArgumentParser,
    add_engine_args,
    optional_float,
    optional_int,
    step_config,
    step_main,
)


def main(argv: list[str] | None = None) -> int:
    p = StepArgumentParser(prog="python -m components.dit", description=__doc__)
    add_engine_args(p)
    p.add_argument("--steps", type=optional_int, default=None, help="denoising steps (default: generation config)")
    p.add_argument("--guidance", type=optional_float, default=None,
                   help="CFG scale >= 0, <= 1 turns CFG off (default: generation config)")
    p.add_argument("--flow-shift", type=optional_float, default=None, help="scheduler shift (default: generation config)")
    p.add_argument("--no-kv-reuse", action="store_true", help="always recompute the prompt K/V")
    p.add_argument("--save-latents", action="store_true", help="also write shards/{k}/latents/{row}.pt")
    p.add_argument("--no-prefetch", action="store_true", help="fetch each row's KV only when it is needed")
    p.add_argument("--step-cache", type=optional_float, default=0.0,
                   help="approximate: skip the deep layers on steps where the first layer's output changed less "
                        "than this fraction (0 = off, the exact path; typical 0.05-0.15)")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="with --tensor-parallel-size N (even): the cond and uncond CFG rows on two groups of N/2 "
                        "GPUs (models with CFG, not Distil)")
    args = p.parse_args(argv)

    def body() -> int:
        from components.dit.run import run as dit_run
        from components.progress import make_progress

        kwargs = {"config": step_config(p, args, argv), "shard": args.shard, "prefetch": not args.no_prefetch}
        with make_progress("auto") as progress:  # with --tensor-parallel-size N: N ranks, rank 0 writes
            result = run_step(dit_run, kwargs, progress, cfg_parallel=args.cfg_parallel)
        print(json.dumps(result, default=str))
        return 0

    return step_main(p.prog, body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
