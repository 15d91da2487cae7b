#!/usr/bin/env bash
# The batch job as a user runs it, on a GPU machine: Mooncake servers on 127.0.0.1, then
# `ardit edit` (tiny model, bf16 on CUDA, KV through Mooncake), then `ardit store down`.
# Run inside a loopback-only network namespace. Usage: bash benchmarks/gpu_job.sh OUTDIR
set -euo pipefail
out=${1:-/tmp/gpu-job}
ardit() { python3 -m pipeline.cli "$@"; }
ardit sample-data "$out/edit.parquet" -n 16
url=$(ardit store up --segment 2GB --state-dir "$out/mooncake" | tail -1)
echo "store: $url"
trap 'ardit store down --state-dir "$out/mooncake"' EXIT
ardit edit "$out/edit.parquet" -o "$out/runs" --run-id gpu --num-shards 2 --kv-store "$url" --device cuda
ardit store keys "$url" --prefix gpu || true
python3 -c "
import json, pyarrow.parquet as pq, glob
rows = [r for f in sorted(glob.glob('$out/runs/gpu/shards/*/rows.parquet')) for r in pq.read_table(f).to_pylist()]
print(len(rows), 'rows;', {r['kv_path'] for r in rows}, 'kv paths; mean DiT step', sum(r['dit_step_s_mean'] for r in rows)/len(rows), 's')
print(json.dumps(json.load(open('$out/runs/gpu/summary.json'))['time_split_s']))
"
