"""python -m components.shard --dataset URI --output URI --run-id ID --num-shards N --kind edit|generate"""

from __future__ import annotations

import argparse
import json
import sys

from components.data.datasets import DatasetError
from components.data.objectstore import ObjectStoreError

from .run import ShardConflictError, run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.shard", description=__doc__)
    p.add_argument("--dataset", required=True, help="Parquet file, directory or s3://bucket/prefix")
    p.add_argument("--output", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True)
    p.add_argument("--num-shards", type=int, required=True)
    p.add_argument("--kind", choices=["edit", "generate"], required=True)
    p.add_argument("--model", default="tiny",
                   help="model whose tokenizer and resolution buckets validate prompts and sizes")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="token budget per prompt (default: the model's)")
    args = p.parse_args(argv)
    from components.steps import model_validators

    count_tokens, is_supported_size, model_budget = model_validators(args.model)
    try:
        manifest = run(args.dataset, args.output, args.run_id, args.num_shards, args.kind,
                       max_prompt_tokens=args.max_prompt_tokens or model_budget, count_tokens=count_tokens,
                       is_supported_size=is_supported_size)
    except ObjectStoreError as exc:  # may be transient: exit 1 so workflow engines retry
        print(f"shard: error: {exc}", file=sys.stderr)
        return 1
    except (DatasetError, ShardConflictError, FileNotFoundError, ValueError) as exc:
        print(f"shard: error: {exc}", file=sys.stderr)
        return 2
    brief = {k: manifest[k] for k in ("run_id", "kind", "num_shards", "num_rows", "num_valid", "num_errors", "created")}
    print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
