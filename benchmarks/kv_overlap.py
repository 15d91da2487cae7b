"""KV wait seen by the DiT loop, with and without the prefetch (issue 12 item 5; target < 2 %).

The DiT step's own KV reader (`components.dit.run._KVReader`) fetches full-size payloads from a
real store while a stand-in for the denoising loop keeps the device busy for `--dit-s` seconds
per row (bf16 matmuls on CUDA, sleep on CPU). Per row it records how long the loop waited for
the KV; the fraction is wait / (wait + DiT time), as the summary reports it per shard.

    python benchmarks/kv_overlap.py --device cuda --dit-s 4.6      # 8 steps x 32 layers x ~18 ms
    python benchmarks/kv_overlap.py --backend local --tokens 2000 --rows 4 --dit-s 0.5   # CPU smoke

Mooncake (default) starts its own servers on 127.0.0.1: run it in a loopback-only namespace,
    unshare -n bash -c 'ip link set lo up && python benchmarks/kv_overlap.py --device cuda'
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.kv_transfer import make_kv  # noqa: E402


def busy(seconds: float, device: str) -> None:
    """Keep the device busy for about `seconds` (the DiT's denoising stand-in)."""
    if not device.startswith("cuda"):
        time.sleep(seconds)
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)


def run(store, rows: int, dit_s: float, device: str, prefetch: bool, tokens: int, layers: int) -> dict:
    from components.dit.run import _KVReader

    kv = make_kv(tokens, layers, 8, 128)
    keys = [f"overlap/0/{i}" for i in range(rows)]
    for k in keys:
        store.put(k, kv)
    nbytes = kv.nbytes()
    del kv
    engine = SimpleNamespace(model=SimpleNamespace(device=torch.device(device)), model_id="hunyuan-image-3",
                             config_hash="bench")
    reader = _KVReader(store, engine, kv_reuse=True)
    ar_row = {"status": "ok", "kv_key": "x", "kv_error": None}
    fetches, waits, gets = {}, [], []
    t_start = time.perf_counter()
    for i in range(rows):
        for j in ([i, i + 1] if prefetch else [i]):
            if j < rows and j not in fetches:
                fetches[j] = reader.fetch(keys[j], ar_row)
        t0 = time.perf_counter()
        got, reason, get_s = reader.result(fetches.pop(i))
        waits.append(time.perf_counter() - t0)
        assert got is not None, reason
        gets.append(get_s)
        del got
        busy(dit_s, device)
        reader.forget(keys[i])
    reader.close()
    total = time.perf_counter() - t_start
    dit = rows * dit_s
    return {"prefetch": prefetch, "rows": rows, "payload_gb": round(nbytes / 1e9, 3),
            "get_s_mean": round(sum(gets) / rows, 4), "wait_s": [round(w, 4) for w in waits],
            "wait_fraction": round(sum(waits) / (sum(waits) + dit), 5), "wall_s": round(total, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["mooncake", "local"], default="mooncake")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=8, help="rows in the shard")
    p.add_argument("--dit-s", type=float, default=4.6, help="seconds of DiT work per row")
    p.add_argument("--tokens", type=int, default=6800)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--segment", default="24GB", help="mooncake segment holder memory")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    from components.kvstore import open_store

    with tempfile.TemporaryDirectory() as tmp:
        servers = None
        if a.backend == "mooncake":
            from components.kvstore.servers import MooncakeServers

            servers = MooncakeServers(segment=a.segment, workdir=Path(tmp) / "mc").start()
            url = servers.url + "&part=64MB"
        else:
            url = f"local://{tmp}/kv"
        try:
            results = []
            for prefetch in (False, True):
                store = open_store(url)
                results.append(run(store, a.rows, a.dit_s, a.device, prefetch, a.tokens, a.layers))
                store.close()
                print(json.dumps(results[-1]))
        finally:
            if servers is not None:
                servers.stop()
    record = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "device": a.device,
              "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else None,
              "backend": a.backend, "args": vars(a), "results": results}
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
