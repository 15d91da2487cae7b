"""Where a local job's seconds before its first step go: the imports and the checks `ardit edit` runs
before any work (components.preflight.check_job), profiled in a fresh process.

    python benchmarks/job_start.py DATASET --model hunyuan-image-3 --pp 2 --quantization fp8

Prints the import times and the check's 25 most expensive calls (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset")
    p.add_argument("--model", default="hunyuan-image-3")
    p.add_argument("--kind", default="edit")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    import pipeline.cli  # noqa: F401
    from components.jobconfig import JobConfig
    from components.preflight import check_job

    t2 = time.perf_counter()
    print(f"import torch {t1 - t0:.2f} s, ardit's CLI {t2 - t1:.2f} s", flush=True)
    profile = cProfile.Profile()
    with tempfile.TemporaryDirectory() as output:
        config = JobConfig(dataset=args.dataset, output=output, run_id="start", kind=args.kind, num_shards=2,
                           model=args.model, dummy_weights=True, tensor_parallel_size=args.tp,
                           pipeline_parallel_size=args.pp, device=args.device, batch_size="auto", steps=8,
                           guidance=5.0, quantization=args.quantization if args.quantization != "none" else None)
        t3 = time.perf_counter()
        profile.enable()
        check_job(config)
        profile.disable()
        print(f"check_job {time.perf_counter() - t3:.2f} s", flush=True)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
