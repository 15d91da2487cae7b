"""How full the AR's decode steps stay over a job's shards: a packing model of the scheduler
(components/engine/ar_scheduler.py), no GPU and no model. It counts decode steps and rows a step for
rows with CoT lengths drawn as ForcedCot's `lognormal:MEDIAN:LO:HI` (sigma ln(HI/LO) / 4), a pool of
--pool slots, and --chunks prefill chunks a row (an edit row: its image block, then its text) at
one chunk a scheduler step, as the scheduler runs them, in two schedules:

    per shard    today's chain: a shard's AR admits only its own rows, so the pool drains at each
                 shard's end (its longest CoTs decode in a thinning batch) before the next starts
    continuous   the next shard's rows join as soon as the slots free up

    python benchmarks/ar_packing_model.py --rows 32 --shards 2 --pool 15

A model, not a measurement: it leaves out the decode step's cost growing with its rows, the DiT's
gate and the K/V budget changing; compare its per-shard figures with a job's record (decode_steps,
mean_batch in each shard's AR scheduler record) before trusting its other column.
"""

from __future__ import annotations

import argparse
import json
import math
import random


def cot_lengths(n: int, median: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    sigma = math.log(hi / lo) / 4
    return [min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def decode_steps(queues: list[list[int]], pool: int, chunks: int) -> tuple[int, float]:
    """(decode steps, mean rows a decode step) for the queues run one after the other; a step with
    only a prompt chunk and no row decoding is not a decode step (as in the scheduler's record)."""
    steps = decoded = 0
    for queue in queues:
        waiting = list(queue)
        rows: list[list[int]] = []  # [tokens left, prefill chunks left]
        while waiting or rows:
            while waiting and len(rows) < pool:
                rows.append([waiting.pop(0), chunks])
            prefilling = next((r for r in rows if r[1] > 0), None)
            if prefilling is not None:  # one prompt chunk a step, between the decode steps
                prefilling[1] -= 1
            batch = [r for r in rows if r[1] == 0 and r is not prefilling]
            for r in batch:
                r[0] -= 1
            steps += bool(batch)
            decoded += len(batch)
            rows = [r for r in rows if r[0] > 0 or r[1] > 0]
    return steps, decoded / max(steps, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="rows a shard")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--pool", type=int, default=15, help="rows in flight (the AR's pool)")
    p.add_argument("--chunks", type=int, default=2, help="prefill chunks a row")
    p.add_argument("--cot", default="1000:200:2048", help="MEDIAN:LO:HI")
    p.add_argument("--jobs", type=int, default=20, help="jobs drawn (seeds 0..N-1), averaged")
    args = p.parse_args()
    median, lo, hi = (int(v) for v in args.cot.split(":"))
    out: dict[str, dict[str, float]] = {}
    for name in ("per shard", "continuous"):
        steps = batch = 0.0
        for seed in range(args.jobs):
            rng = random.Random(seed)
            shards = [cot_lengths(args.rows, median, lo, hi, rng) for _ in range(args.shards)]
            s, b = decode_steps(shards if name == "per shard" else [sum(shards, [])], args.pool, args.chunks)
            steps, batch = steps + s / args.jobs, batch + b / args.jobs
        out[name] = {"steps": round(steps, 1), "steps_a_shard": round(steps / args.shards, 1),
                     "rows_a_decode_step": round(batch, 2)}
    out["continuous_steps_saved"] = round(1 - out["continuous"]["steps"] / out["per shard"]["steps"], 3)
    print(json.dumps({"rows": args.rows, "shards": args.shards, "pool": args.pool, "cot": args.cot, **out}))


if __name__ == "__main__":
    main()
