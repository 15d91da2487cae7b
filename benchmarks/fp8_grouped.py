"""The routed experts' FP8 GEMMs at AR decode sizes: `torch._scaled_grouped_mm` (CUTLASS) vs the
few-rows Triton kernel (kernels/fp8_grouped.py), full model dimensions (64 experts, hidden 4096,
expert width 3072, top-8), uniform routing.

    python3 benchmarks/fp8_grouped.py --out $OUT/fp8_grouped.json

Per decode batch (tokens): both GEMMs (gate_up [E, 6144, 4096], down [E, 4096, 3072]) timed as CUDA
graph replays (CUDA events, median), the Triton kernel over a few tile configurations, their max
relative difference from CUTLASS and from an fp32 reference, and the weight bytes of the experts the
batch touches over the measured copy bandwidth (the floor).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.decode_kernels import copy_bandwidth  # noqa: E402
from benchmarks.engine_layers import cuda_time  # noqa: E402
from components.engine.kernels.decode import StaticDecoder  # noqa: E402
from components.engine.kernels.fp8_grouped import grouped_mm_few_rows  # noqa: E402
from components.engine.kernels.moe import sort_by_expert  # noqa: E402
from components.engine.quant import quantize_rowwise  # noqa: E402

E, HIDDEN, WIDTH, TOP_K = 64, 4096, 3072, 8
CONFIGS = [(64, 4, 4), (64, 5, 4), (128, 4, 4), (128, 4, 8), (32, 4, 4)]  # (block_n, stages, warps)


def replay_us(fn) -> float:
    fn()
    graph, _ = StaticDecoder.capture(fn)
    return cuda_time(graph.replay, warmup=3, repeat=20) * 1e3


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,16,32,42,64,128")
    p.add_argument("--out", default="fp8_grouped.json")
    args = p.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    weights = {}
    for name, (n, k) in {"gate_up": (2 * WIDTH, HIDDEN), "down": (HIDDEN, WIDTH)}.items():
        q, s = quantize_rowwise(torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
        weights[name] = (q, s)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "copy_bandwidth_TBps": round(bandwidth / 1e12, 2), "batches": []}
    print(f"{'tokens':>6}{'gemm':>8}{'floor us':>9}{'cutlass us':>11}{'triton us':>10}{'best cfg':>14}"
          f"{'rel vs cutlass':>15}{'rel vs fp32':>12}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        experts = torch.rand(tokens, E, device="cuda").topk(TOP_K, dim=1).indices
        order, token, offs = sort_by_expert(experts, E)
        touched = int((torch.bincount(experts.flatten(), minlength=E) > 0).sum())
        row = {"tokens": tokens, "experts_touched": touched}
        for name, (w, sw) in weights.items():
            k = w.shape[2]
            a, sa = quantize_rowwise(torch.randn(tokens * TOP_K, k, device="cuda", dtype=torch.bfloat16))

            def cutlass():
                return torch._scaled_grouped_mm(a, w.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16)

            ref_rows = []
            start = 0
            for e, end in enumerate(offs.tolist()):
                ref_rows.append((a[start:end].float() @ w[e].float().T) * sa[start:end, None] * sw[e][None, :])
                start = end
            ref = torch.cat(ref_rows)
            c_out = cutlass().float()
            r = {"floor_us": round(touched * w[0].numel() / bandwidth * 1e6, 1),
                 "cutlass_us": round(replay_us(cutlass), 1),
                 "cutlass_rel_vs_fp32": ((c_out - ref).norm() / ref.norm()).item(), "triton": {}}
            best = None
            for block_n, stages, warps in CONFIGS:
                def triton_fn(block_n=block_n, stages=stages, warps=warps):
                    return grouped_mm_few_rows(a, w, sa, sw, offs, block_n=block_n, num_stages=stages, num_warps=warps)

                try:
                    t_out = triton_fn().float()
                    us = round(replay_us(triton_fn), 1)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    r["triton"][f"{block_n}/{stages}/{warps}"] = {"error": repr(e)[:200]}
                    continue
                entry = {"us": us, "rel_vs_cutlass": ((t_out - c_out).norm() / c_out.norm()).item(),
                         "rel_vs_fp32": ((t_out - ref).norm() / ref.norm()).item()}
                r["triton"][f"{block_n}/{stages}/{warps}"] = entry
                if best is None or us < best[1]["us"]:
                    best = (f"{block_n}/{stages}/{warps}", entry)
            row[name] = r
            if best:
                print(f"{tokens:>6}{name:>8}{r['floor_us']:>9}{r['cutlass_us']:>11}{best[1]['us']:>10}{best[0]:>14}"
                      f"{best[1]['rel_vs_cutlass']:>15.2e}{best[1]['rel_vs_fp32']:>12.2e}", flush=True)
        results["batches"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
