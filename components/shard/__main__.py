"""python -m components.shard --dataset URI --output URI --run-id ID --num-shards N --kind edit|generate

Exit codes: 0 ok, 1 storage failed (may be transient: orchestrators retry), 2 configuration error
(bad dataset, columns, run id, options: one line on stderr)."""

from __future__ import annotations

import argparse
import json
import sys

from components.step_program import StepArgumentParser, step_main


def main(argv: list[str] | None = None) -> int:
    p = StepArgumentParser(prog="python -m components.shard", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help="Parquet file, directory or s3://bucket/prefix")
    p.add_argument("--output", "-o", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True, help="name of the run (a new one, or an existing one to resume)")
    p.add_argument("--num-shards", type=int, required=True, help="shards to split the dataset into (>= 1)")
    p.add_argument("--kind", choices=["edit", "generate"], required=True, help="dataset kind")
    p.add_argument("--model", default="tiny",
                   help="model whose tokenizer and resolution buckets validate prompts and sizes")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="token budget per prompt (default: the model's)")
    p.add_argument("--debug", action="store_true", help="show tracebacks of configuration errors")
    args = p.parse_args(argv)

    def body() -> int:
        from components.data.datasets import DatasetError
        from components.data.objectstore import ObjectStoreError, S3AccessError
        from components.errors import ConfigError
        from components.preflight import check_dataset
        from components.models import model_validators

        from .run import run

        if args.num_shards < 1:
            raise ConfigError(f"--num-shards {args.num_shards}: must be >= 1")
        count_tokens, is_supported_size, model_budget = model_validators(args.model)
        try:
            check_dataset(args.dataset, args.kind)
            manifest = run(args.dataset, args.output, args.run_id, args.num_shards, args.kind,
                           max_prompt_tokens=args.max_prompt_tokens or model_budget, count_tokens=count_tokens,
                           is_supported_size=is_supported_size)
        except (S3AccessError, DatasetError) as exc:
            raise ConfigError(str(exc)) from None
        except ObjectStoreError as exc:  # may be transient: exit 1 so workflow engines retry
            print(f"{p.prog}: error: {exc}", file=sys.stderr)
            return 1
        brief = {k: manifest[k] for k in ("run_id", "kind", "num_shards", "num_rows", "num_valid", "num_errors",
                                           "created")}
        print(json.dumps(brief))
        return 0

    return step_main(p.prog, body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
