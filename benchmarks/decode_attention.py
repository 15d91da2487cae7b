"""The AR decode step's attention on the GPU: SDPA over the whole span (grouped heads, what the
static step ran before) vs the split-KV kernel that reads each row to its own length
(kernels/decode_attention.py), at the full model's heads (32 query / 8 KV, head dim 128; and the
per-rank heads of --tp 2), in bf16.

    python3 benchmarks/decode_attention.py --out $OUT/decode_attention.json

Cases: the continuous-batching pool as measured on the full model (42 slots, span 7 168, rows of
mixed lengths: half ~1.2k T2I prompts, half ~5.2k edit prompts, plus their CoT; a few free slots),
and uniform batches at full length (where the split kernel saves no reads: its own speed). Per case:
the kernel's max abs difference from SDPA and from an fp32 reference, whether its CUDA-graph replay
equals its eager run bitwise, both timings (graph replays, CUDA events), and the bytes each must read
over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.decode_kernels import copy_bandwidth  # noqa: E402
from benchmarks.engine_layers import cuda_time  # noqa: E402
from components.engine.kernels import decode_attention  # noqa: E402
from components.engine.kernels.decode import DecodeMask, StaticDecoder  # noqa: E402


def _lengths(case: str, rows: int, span: int, gen: torch.Generator) -> list[int]:
    if case == "pool":  # mixed rows as the scheduler's pool holds them; ~1 in 6 slots free (length 1)
        out = []
        for i in range(rows):
            if i % 6 == 5:
                out.append(1)
                continue
            prompt = 1200 if i % 2 else 5200
            out.append(min(span, prompt + int(torch.randint(30, 1500, (1,), generator=gen))))
        return out
    return [span] * rows


@torch.no_grad()
def run_case(case: str, rows: int, heads: int, kv_heads: int, span: int, bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(rows * 7 + heads)
    d, capacity = 128, span + 512
    lengths = _lengths(case, rows, span, gen)
    torch.manual_seed(rows)
    q = torch.randn(rows, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(rows, kv_heads, capacity, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k, v = k_cache[:, :, :span], v_cache[:, :, :span]
    kv_len = torch.tensor(lengths, device="cuda")
    keep = (torch.arange(span, device="cuda") < kv_len[:, None]).view(rows, 1, 1, span)
    mask = DecodeMask(keep, kv_len)
    groups = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.float().reshape(rows, kv_heads, groups, d), k.float(), v.float(),
                                         attn_mask=keep).reshape(rows, heads, 1, d)
    sdpa = mask.sdpa(q, k, v)
    split = decode_attention.split_kv_attention(q, k, v, keep, kv_len)
    res = {"case": case, "rows": rows, "heads": heads, "kv_heads": kv_heads, "span": span,
           "mean_length": round(sum(lengths) / rows, 1),
           "split_vs_sdpa_max_abs": (split.float() - sdpa.float()).abs().max().item(),
           "split_vs_fp32_max_abs": (split.float() - ref).abs().max().item(),
           "sdpa_vs_fp32_max_abs": (sdpa.float() - ref).abs().max().item()}
    for name, fn in (("sdpa", lambda: mask.sdpa(q, k, v)),
                     ("split", lambda: decode_attention.split_kv_attention(q, k, v, keep, kv_len))):
        eager = fn().clone()
        graph, out = StaticDecoder.capture(fn)
        graph.replay()
        res[f"{name}_replay_equals_eager"] = bool(torch.equal(out, eager))
        res[f"{name}_us"] = round(cuda_time(graph.replay, warmup=3, repeat=20) * 1e3, 1)
    kv_bytes = 2 * kv_heads * d * 2  # K and V of one slot
    res["sdpa_floor_us"] = round(rows * span * kv_bytes / bandwidth * 1e6, 1)
    res["split_floor_us"] = round(sum(lengths) * kv_bytes / bandwidth * 1e6, 1)
    res["speedup"] = round(res["sdpa_us"] / res["split_us"], 2)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="decode_attention.json")
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    cases = [("pool", 42, 32, 8, 7168), ("pool", 42, 16, 4, 7168), ("pool", 16, 32, 8, 7168),
             ("full", 1, 32, 8, 7168), ("full", 8, 32, 8, 7168), ("full", 32, 32, 8, 7168),
             ("full", 64, 32, 8, 7168), ("full", 32, 32, 8, 2048)]
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "copy_bandwidth_TBps": round(bandwidth / 1e12, 2), "cases": []}
    print(f"{'case':6}{'rows':>5}{'heads':>7}{'span':>6}{'mean len':>9}{'sdpa us':>9}{'split us':>9}"
          f"{'floor us':>9}{'x':>6}{'|split-sdpa|':>13}{'|split-fp32|':>13}{'|sdpa-fp32|':>12}{'replay==eager':>14}")
    for case in cases:
        r = run_case(*case, bandwidth)
        results["cases"].append(r)
        print(f"{r['case']:6}{r['rows']:>5}{r['heads']:>4}/{r['kv_heads']:<2}{r['span']:>6}{r['mean_length']:>9}"
              f"{r['sdpa_us']:>9}{r['split_us']:>9}{r['split_floor_us']:>9}{r['speedup']:>6}"
              f"{r['split_vs_sdpa_max_abs']:>13.2e}{r['split_vs_fp32_max_abs']:>13.2e}"
              f"{r['sdpa_vs_fp32_max_abs']:>12.2e}{str(r['split_replay_equals_eager']):>14}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
