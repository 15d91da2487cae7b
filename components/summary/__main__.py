"""python -m components.summary --output URI --run-id ID [--require-complete]"""

from __future__ import annotations

import argparse
import json
import sys

from components.data.objectstore import ObjectStoreError

from .run import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.summary", description=__doc__)
    p.add_argument("--output", required=True, help="output root: a directory or s3://bucket/prefix")
    p.add_argument("--run-id", required=True)
    p.add_argument("--require-complete", action="store_true",
                   help="exit with status 3 when some shard is not committed")
    args = p.parse_args(argv)
    try:
        summary = run(args.output, args.run_id)
    except (FileNotFoundError, ObjectStoreError, ValueError) as exc:
        print(f"summary: error: {exc}", file=sys.stderr)
        return 2
    brief = {k: summary[k] for k in ("run_id", "rows_total", "rows_ok", "rows_failed", "rows_pending", "complete",
                                     "shards_missing", "shards_uncommitted", "images_per_minute")}
    print(json.dumps(brief))
    return 3 if args.require_complete and not summary["complete"] else 0


if __name__ == "__main__":
    sys.exit(main())
