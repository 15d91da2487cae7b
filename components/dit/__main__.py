"""python -m components.dit --output URI --run-id ID --shard K [--model tiny] [--kv-store URL] [--steps N --guidance G]"""

from __future__ import annotations

import argparse
import json
import sys

from components.steps import add_engine_args, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.dit", description=__doc__)
    add_engine_args(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--flow-shift", type=float, default=3.0)
    p.add_argument("--no-kv-reuse", action="store_true", help="always recompute the prompt K/V")
    p.add_argument("--save-latents", action="store_true", help="also write shards/{k}/latents/{row}.pt")
    args = p.parse_args(argv)
    from components.dit.run import run

    result = run(args.output, args.run_id, args.shard, steps=args.steps, guidance=args.guidance,
                 flow_shift=args.flow_shift, kv_reuse=not args.no_kv_reuse, save_latents=args.save_latents,
                 **engine_kwargs(args))
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
