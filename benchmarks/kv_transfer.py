"""KV handoff throughput: one process puts a real-shape PromptKV, exits; another gets it.

Full size by default: 32 layers x 8 kv heads x 128 head_dim, bf16, 6800 prefix tokens
(128 KiB per token, ~0.89 GB per request). For each backend: one cold put/get (first use:
buffer allocation, page faults), then --repeats warm ones; GB/s = payload bytes / wall time of
store.put / store.get (get includes crc32 verification and the copy out of the transfer buffer).
Next to it: a same-process memcpy of the same bytes (1 thread and all threads) and crc32 alone.

    python benchmarks/kv_transfer.py                      # mooncake (own servers on 127.0.0.1) + local
    python benchmarks/kv_transfer.py --tokens 2000 --backends local
    python benchmarks/kv_transfer.py --part 32MB --part 256MB   # compare part sizes (mooncake)
    python benchmarks/kv_transfer.py --put-streams 8 --get-groups 2 --backends mooncake

On a machine with other network interfaces, run it inside a loopback-only namespace:
    unshare -n bash -c 'ip link set lo up && .venv/bin/python benchmarks/kv_transfer.py'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

GB = 1e9


def make_kv(tokens: int, layers: int, heads: int, head_dim: int, seed: int = 0):
    from components.engine.kvcache import PromptKV

    g = torch.Generator().manual_seed(seed)
    shape = (tokens, heads, head_dim)
    # random bits viewed as bf16: fast to make, every byte differs
    mk = lambda: torch.randint(
        -(2**15), 2**15, shape, dtype=torch.int16, generator=g
    ).view(torch.bfloat16)
    return PromptKV(
        keys=[mk() for _ in range(layers)],
        values=[mk() for _ in range(layers)],
        token_ids=list(range(tokens)),
        pos_reuse_len=tokens,
        neg_reuse_len=max(1, tokens - 580),
        model_id="hunyuan-image-3",
        config_hash="bench",
        meta={"bench": True},
    )


# ---------------------------------------------------------------- child roles


def role_producer(a: argparse.Namespace) -> dict:
    from components.kvstore import open_store

    kv = make_kv(a.tokens, a.layers, a.heads, a.head_dim)
    store = open_store(a.url)
    out = []
    for r in range(a.repeats + 1):
        t = time.perf_counter()
        n = store.put(f"bench/{r}/0", kv)
        out.append(
            {"s": time.perf_counter() - t, "bytes": n, **getattr(store, "last", {})}
        )
    store.close()
    return {"puts": out}


def role_consumer(a: argparse.Namespace) -> dict:
    from components.kvstore import open_store

    store = open_store(a.url)
    out = []
    for r in range(a.repeats + 1):
        key = f"bench/{r}/0"
        t = time.perf_counter()
        res = store.get(key, "hunyuan-image-3", "bench")
        dt = time.perf_counter() - t
        if not res.ok:
            raise SystemExit(f"get {key}: {res.reason}")
        if (
            res.kv.keys[0].shape != (a.tokens, a.heads, a.head_dim)
            or res.kv.dtype != torch.bfloat16
        ):
            raise SystemExit(
                f"get {key}: wrong shape/dtype {res.kv.keys[0].shape} {res.kv.dtype}"
            )
        out.append({"s": dt, "bytes": res.kv.nbytes(), **getattr(store, "last", {})})
        del res
        store.delete(key)  # as the DiT does after committing the image
    left = store.keys("bench")
    store.close()
    return {"gets": out, "keys_left": left}


def memcpy_baseline(nbytes: int, repeats: int) -> dict:
    from components.kvstore.payload import _crc_chunked, parallel_copy, thread_pool

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)  # fault the pages in: we measure copying, not the kernel
    res = {"memcpy_1t_s": [], "memcpy_mt_s": [], "crc32_1t_s": [], "crc32_mt_s": []}
    chunk = 64 << 20
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        res["memcpy_1t_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        parallel_copy(dst, src)
        res["memcpy_mt_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _crc_chunked(src)
        res["crc32_1t_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        list(
            thread_pool().map(
                lambda s: _crc_chunked(src[s : s + chunk]), range(0, nbytes, chunk)
            )
        )
        res["crc32_mt_s"].append(time.perf_counter() - t)
    return res


# ---------------------------------------------------------------- driver


def run_child(role: str, a: argparse.Namespace, url: str) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--url",
        url,
        "--tokens",
        str(a.tokens),
        "--layers",
        str(a.layers),
        "--heads",
        str(a.heads),
        "--head-dim",
        str(a.head_dim),
        "--repeats",
        str(a.repeats),
    ]
    p = subprocess.run(argv, check=False, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(
            f"{role} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarise(samples: list[dict]) -> dict:
    nbytes = samples[0]["bytes"]
    warm = samples[1:]
    rates = [nbytes / s["s"] / GB for s in warm]
    phases = {
        k: statistics.median(s[k] for s in warm)
        for k in warm[0]
        if k.endswith("_s") and k != "s"
    }
    return {
        "bytes": nbytes,
        "cold_gbps": nbytes / samples[0]["s"] / GB,
        "gbps": rates,
        "median_gbps": statistics.median(rates),
        "median_phase_s": phases,
    }


def bench_backend(name: str, url: str, a: argparse.Namespace) -> dict:
    prod = run_child("producer", a, url)
    cons = run_child("consumer", a, url)
    if cons["keys_left"]:
        raise SystemExit(
            f"{name}: keys left after the consumer deleted them: {cons['keys_left']}"
        )
    return {
        "backend": name,
        "url": url,
        "put": summarise(prod["puts"]),
        "get": summarise(cons["gets"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backends", default="mooncake,local")
    ap.add_argument("--tokens", type=int, default=6800)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--part", action="append", help="mooncake part size(s), e.g. 64MB (repeatable)"
    )
    ap.add_argument(
        "--put-streams",
        action="append",
        type=int,
        help="mooncake put: parts in flight as they are encoded (repeatable; 1 = encode, "
        "then one batch call; default 1 and 4)",
    )
    ap.add_argument(
        "--get-groups",
        action="append",
        type=int,
        help="mooncake get: sequential batch calls overlapped with decoding (repeatable; "
        "default 1 and 4)",
    )
    ap.add_argument(
        "--segment",
        default="",
        help="segment holder size (default: 2 x payload + 1 GB)",
    )
    ap.add_argument(
        "--url",
        default="",
        help="use this store instead of starting servers / a temp dir",
    )
    ap.add_argument(
        "--local-dir",
        default=None,
        help="parent dir for the local backend (default $TMPDIR)",
    )
    ap.add_argument("--json", default="kv_transfer.json")
    ap.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        print(json.dumps((role_producer if a.role == "producer" else role_consumer)(a)))
        return

    nbytes = (
        a.tokens * 2 * a.layers * a.heads * a.head_dim * 2
    )  # K and V, bf16 (header: a few KB more)
    print(
        f"payload ~{nbytes / GB:.3f} GB ({a.tokens} tokens, {a.layers} layers, {a.heads}x{a.head_dim}, bf16), "
        f"{a.repeats} warm repeats + 1 cold, {os.cpu_count()} CPUs",
        flush=True,
    )
    results = []
    for b in a.backends.split(","):
        if b == "local":
            with tempfile.TemporaryDirectory(
                dir=a.local_dir, prefix="ardit-kvbench-"
            ) as d:
                results.append(
                    bench_backend(
                        "local",
                        a.url if a.url.startswith("local") else f"local://{d}",
                        a,
                    )
                )
        elif b == "mooncake":
            combos = [
                (
                    f"mooncake {p} put x{ps} get /{gg}",
                    f"&part={p}&put_streams={ps}&get_groups={gg}",
                )
                for p in (a.part or ["64MB"])
                for ps in (a.put_streams or [1, 4])
                for gg in (a.get_groups or [1, 4])
            ]
            if a.url.startswith("mooncake://"):
                for label, q in combos:
                    results.append(bench_backend(label, a.url + q, a))
                    print(f"  {label}: done", flush=True)
                continue
            from components.kvstore.servers import MooncakeServers

            # a payload per warm repeat plus the cold one is in flight before the consumer runs
            seg = a.segment or f"{int(nbytes * (a.repeats + 1) * 1.25 / 2**20) + 256}MB"
            with MooncakeServers(segment=seg) as srv:
                for label, q in combos:
                    results.append(bench_backend(label, srv.url + q, a))
                    print(f"  {label}: done", flush=True)
            continue
        else:
            raise SystemExit(f"unknown backend {b!r} (mooncake, local)")
        print(f"  {results[-1]['backend']}: done", flush=True)
    base = memcpy_baseline(nbytes, a.repeats)

    def rate(xs):
        return statistics.median(nbytes / x / GB for x in xs)

    print(
        f"\n{'backend':<22} {'put GB/s (median, runs)':<30} {'get GB/s (median, runs)':<30} cold put/get"
    )
    for r in results:
        f = lambda s: (
            f"{s['median_gbps']:5.2f} ({', '.join(f'{x:.2f}' for x in s['gbps'])})"
        )
        print(
            f"{r['backend']:<22} {f(r['put']):<30} {f(r['get']):<30} {r['put']['cold_gbps']:.2f}/{r['get']['cold_gbps']:.2f}"
        )
        print(
            f"{'':<22} put phases {r['put']['median_phase_s']}  get phases {r['get']['median_phase_s']}"
        )
    print(
        f"same-process memcpy: 1 thread {rate(base['memcpy_1t_s']):.2f} GB/s, "
        f"{min(16, os.cpu_count() or 1)} threads {rate(base['memcpy_mt_s']):.2f} GB/s; "
        f"crc32: 1 thread {rate(base['crc32_1t_s']):.2f} GB/s, pool {rate(base['crc32_mt_s']):.2f} GB/s"
    )
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
        "payload_bytes": nbytes,
        "results": results,
        "baseline": base,
    }
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1])
    )  # run from a checkout without install
    main()
