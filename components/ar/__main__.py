"""python -m components.ar --output URI --run-id ID --shard K [--model tiny] [--kv-store URL] ..."""

from __future__ import annotations

import argparse
import json
import sys

from components.steps import add_engine_args, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.ar", description=__doc__)
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=8, help="rows per batched prefill/decode")
    p.add_argument("--bot-task", default="think_recaption", choices=["image", "recaption", "think", "think_recaption"])
    p.add_argument("--system-prompt", default="en_unified")
    p.add_argument("--max-new-tokens", type=int, default=48, help="CoT token budget per stage")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args(argv)
    from components.ar.run import run

    result = run(args.output, args.run_id, args.shard, batch_size=args.batch_size, bot_task=args.bot_task,
                 system_prompt=args.system_prompt, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **engine_kwargs(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
