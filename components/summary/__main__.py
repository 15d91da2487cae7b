"""python -m components.summary --output URI --run-id ID [--require-complete]

Exit codes: 0 ok, 2 no such run / configuration error (one line), 3 with --require-complete when
some shard is not committed."""

from __future__ import annotations

import sys

from components.step_program import StepArgumentParser, step_main


def main(argv: list[str] | None = None) -> int:
    p = StepArgumentParser(prog="python -m components.summary", description=__doc__)
    p.add_argument("--output", "-o", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True, help="the run to summarize")
    p.add_argument("--require-complete", action="store_true",
                   help="exit with status 3 when some shard is not committed")
    p.add_argument("--debug", action="store_true", help="show tracebacks of configuration errors")
    args = p.parse_args(argv)

    def body() -> int:
        import json

        from components.data.objectstore import ObjectStoreError, TransientStorageError
        from components.errors import ConfigError

        from .run import run

        try:
            summary = run(args.output, args.run_id)
        except TransientStorageError:
            raise  # may pass (S3 5xx, timeout): exit 1, so the orchestrator retries
        except (FileNotFoundError, ObjectStoreError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        brief = {k: summary[k] for k in ("run_id", "rows_total", "rows_ok", "rows_failed", "rows_pending",
                                         "complete", "shards_missing", "shards_uncommitted", "images_per_minute")}
        print(json.dumps(brief))
        return 3 if args.require_complete and not summary["complete"] else 0

    return step_main(p.prog, body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
