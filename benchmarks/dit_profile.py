"""Where one DiT denoising step of the FP8 model spends its time, kernel by kernel, against the
arithmetic it must do (full-width layers, dummy weights, one GPU).

    python3 benchmarks/dit_profile.py --layers 4 --out $OUT/dit_profile.json
    python3 benchmarks/dit_profile.py --layers 4 --rows 2 --out $OUT/dit_profile_rows2.json
    python3 benchmarks/dit_profile.py --layers 4 --prefill 4096 --prefix 64 --out $OUT/prefill.json

`--rows N`: N rows of one bucket (same prefix length) in one step forward, batch 2N with CFG; the
times are then also given per row, against `--rows 1`, to see what batching rows would gain.
`--prefill T`: instead of a step, a prefill of T new tokens of one row over the cached prefix (as
the AR's prompt chunks and the DiT's reuse prefix run it: a SlotMask, the chunk one image block
with `--prefill-block image`, causal text otherwise), eager as the engine runs it by default and
through the compiled regions as `compile_prefill=on` runs it (graphs dynamic in the token count).
`--save-output F` keeps the step's output hidden states and `--compare-to F ...` gives the relative
difference of this run's output to saved ones: e.g. a run with `ARDIT_KERNELS=fp8_accum=fast`
against one with `fp8_accum=exact` and one with `--precision bf16` (the same seeded weights, K/V
and inputs), to set the fast accumulation's error beside FP8's own.

A `--layers`-layer FP8 stack (`engine.build_model_fp8`), a cached prompt prefix of `--prefix`
tokens (random K/V) and one cached step as the DiT runs it at `--size` with CFG: both rows'
`<timestep>` + image tokens through `forward_layers(..., compiled=True)` over the prefix (the
`<timestep>` row masked, the image block unmasked: transformer.HeadMask). It times the step with
CUDA events, counts its FLOPs (projections, attention, routed and shared experts, router) and gives
the achieved rate against the FP8 dense peak (`--peak-tflops`, the H100 / H200 datasheet's 1979 by
default), then a torch.profiler table of the same step, per layer, by kernel and by kind (GEMMs,
attention, MoE routing and permutation, norms and RoPE, the rest).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.decode_profile import kernel_rows, report  # noqa: E402
from benchmarks.engine_layers import cuda_time  # noqa: E402
from components.engine.config import get_config  # noqa: E402
from components.engine.engine import build_model, build_model_fp8, materialize  # noqa: E402
from components.engine.transformer import HeadMask, SlotMask  # noqa: E402

KINDS = [  # kernel name pattern -> kind (first match wins: cuDNN's attention kernels name sm90 too)
    ("attention", r"flash|fmha|attention|sdpa|flex"),
    ("gemm", r"gemm|cutlass|nvjet|sm90|matmul|wgmma|fp8_grouped"),
    ("quantize / swiglu", r"scaled_(grouped_)?mm|amax"),
    ("moe routing", r"topk|sort|scatter|gather|index|cumsum|histc|bincount|radix|argsort"),
    ("norms / rope / casts", r"norm|rsqrt|rope|pow|mean|triton_(poi|red|per)"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def step_flops(cfg, tokens: int, keys: int) -> dict[str, float]:
    """FLOPs of one layer for `tokens` query tokens over `keys` keys (both CFG rows together)."""
    h, d = cfg.hidden_size, cfg.attention_head_dim
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    topk = cfg.moe_topk[0] if isinstance(cfg.moe_topk, list) else cfg.moe_topk
    inter = cfg.moe_intermediate_size[0] if isinstance(cfg.moe_intermediate_size, list) else cfg.moe_intermediate_size
    shared = cfg.num_shared_expert[0] if isinstance(cfg.num_shared_expert, list) else cfg.num_shared_expert
    expert = 2 * tokens * (h * 2 * inter + inter * h)
    return {"projections": 2 * tokens * h * ((q + 2 * kv) * d + q * d),
            "attention": 4 * tokens * keys * q * d,
            "routed experts": topk * expert, "shared expert": shared * expert,
            "router": 2 * tokens * h * cfg.num_experts}


def random_cache(model, rows: int, capacity: int):
    """A KV cache of `rows` x `capacity` slots filled with random K/V (what a prefix holds is not timed)."""
    cache = model.new_cache(rows, capacity)
    for k in cache.k + cache.v:
        k.normal_()
    return cache


def kernels_by_kind(prof, per_layer: int) -> tuple[list[dict], dict[str, float]]:
    """A profiler run's kernels (with their kind) and microseconds a layer per kind, largest first."""
    kernels = [{**k, "kind": kind_of(k["name"])} for k in kernel_rows(prof, per_layer)]
    kinds: dict[str, float] = {}
    for k in kernels:
        kinds[k["kind"]] = round(kinds.get(k["kind"], 0.0) + k["us_per_layer"], 1)
    return kernels, dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefix", type=int, default=5400, help="cached prompt tokens (a 1024x1024 edit's, ~5.4k)")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--peak-tflops", type=float, default=1979.0)
    p.add_argument("--rows", type=int, default=1, help="rows of one bucket per step forward (batch 2 x rows)")
    p.add_argument("--prefill", type=int, default=0, help="T > 0: time a T-token prefill of one row instead")
    p.add_argument("--prefill-block", choices=["image", "text"], default="image")
    p.add_argument("--precision", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--save-output", help="write the step's output hidden states here (torch.save)")
    p.add_argument("--compare-to", nargs="*", default=[], help="saved outputs to compare this run's with")
    p.add_argument("--out", default="dit_profile.json")
    p.add_argument("--check", action="store_true", help="the tiny config in float32 on the CPU (this script's own test)")
    args = p.parse_args()

    torch.manual_seed(0)  # the same K/V and inputs in every run, for --compare-to
    device = "cpu" if args.check else "cuda"
    if args.check:
        cfg = get_config("tiny")
        args.layers, args.prefix, args.size = cfg.num_hidden_layers, 64, 128
    else:
        cfg = get_config("hunyuan-image-3").replace(num_hidden_layers=args.layers)
    if args.check or args.precision == "bf16":  # unquantized, the same seeded weights as the FP8 stack's
        model = build_model(cfg, device, allocate=False)
        materialize(model, device, None, 0)
        model.eval()
    else:
        model = build_model_fp8(cfg, device, seed=0)
    if args.prefill > 0 and not args.check:
        return prefill_profile(model, cfg, args)
    image = (args.size // 16) ** 2
    t = 1 + image  # <timestep> + the image tokens
    batch = 2 * args.rows  # [cond; uncond] per row
    cache = random_cache(model, batch, args.prefix + t)
    cache.length = args.prefix
    x = torch.randn(batch, t, cfg.hidden_size, device=device, dtype=model.dtype)
    side = int(image ** 0.5)
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2)
    positions = torch.cat([torch.full((1, 2), args.prefix), grid + args.prefix + 1]).float()
    positions = positions.expand(batch, -1, -1).to(device)
    mask = HeadMask(torch.ones(batch, 1, 1, args.prefix + t, dtype=torch.bool, device=device), rows=1)

    def step():
        return model.forward_layers(x, positions, mask, cache, compiled=True)

    if args.check:
        step()
        print(json.dumps({"check": "ok", "flops": step_flops(cfg, batch * t, args.prefix + t)}))
        return 0
    with model.autocast():
        output = step().float() if args.save_output or args.compare_to else None
        ms = cuda_time(step, warmup=3, repeat=10)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        runs = 3
        with prof:
            for _ in range(runs):
                step()
            torch.cuda.synchronize()
    flops = step_flops(cfg, batch * t, args.prefix + t)
    per_layer_ms = ms / args.layers
    total = sum(flops.values())
    kernels, kinds = kernels_by_kind(prof, runs * args.layers)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
              "prefix": args.prefix, "size": args.size, "tokens": batch * t, "rows": args.rows,
              "ms_per_layer": round(per_layer_ms, 3), "ms_per_step_32_layers": round(per_layer_ms * 32, 1),
              "ms_per_row_step_32_layers": round(per_layer_ms * 32 / args.rows, 1),
              "tflop_per_layer": round(total / 1e12, 3),
              "achieved_tflops": round(total / (per_layer_ms / 1e3) / 1e12, 1),
              "fraction_of_peak": round(total / (per_layer_ms / 1e3) / 1e12 / args.peak_tflops, 3),
              "flops_by_part": {k: round(v / 1e12, 3) for k, v in flops.items()},
              "kernel_us_per_layer_by_kind": kinds,
              "kernels": kernels}
    if args.save_output:
        torch.save(output.cpu(), args.save_output)
    for other in args.compare_to:  # relative L2 difference of the outputs
        theirs = torch.load(other).to(output.device)
        result.setdefault("output_rel_diff_to", {})[other] = round(
            ((output - theirs).norm() / theirs.norm()).item(), 6)
    report(result, args.out, top=30, kind=True)
    return 0


def prefill_profile(model, cfg, args) -> int:
    """`--prefill T`: one row's T new tokens over `--prefix` cached ones, eager and compiled."""
    device, t, prefix = "cuda", args.prefill, args.prefix
    cache = random_cache(model, 1, prefix + t)
    x = torch.randn(1, t, cfg.hidden_size, device=device, dtype=model.dtype)
    slots = torch.arange(prefix + t)
    blocks = torch.full((prefix + t,), -1)
    if args.prefill_block == "image":
        blocks[prefix:] = 0
    mask = SlotMask(slots[prefix:].unsqueeze(0), slots.unsqueeze(0), blocks[prefix:].unsqueeze(0),
                    blocks.unsqueeze(0)).to(device)
    positions = torch.arange(prefix, prefix + t).float()[:, None].expand(-1, 2).unsqueeze(0).to(device)

    def chunk(compiled: bool):
        cache.length = prefix  # every run writes the same slots
        return model.forward_layers(x, positions, mask, cache, compiled=compiled, prefill=True)

    flops = step_flops(cfg, t, prefix + t // 2)
    total = sum(flops.values())
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
              "prefill_tokens": t, "prefix": prefix, "block": args.prefill_block,
              "tflop_per_layer": round(total / 1e12, 3)}
    with model.autocast():
        for name, compiled in (("eager", False), ("compiled", True)):
            ms = cuda_time(lambda: chunk(compiled), warmup=3, repeat=10) / args.layers
            result[f"{name}_ms_per_layer"] = round(ms, 3)
            result[f"{name}_ms_32_layers"] = round(ms * 32, 1)
            result[f"{name}_fraction_of_peak"] = round(total / (ms / 1e3) / 1e12 / args.peak_tflops, 3)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        runs = 3
        with prof:
            for _ in range(runs):
                chunk(False)
            torch.cuda.synchronize()
    kernels, kinds = kernels_by_kind(prof, runs * args.layers)
    result["eager_kernel_us_per_layer_by_kind"] = kinds
    result["kernels"] = kernels
    report(result, args.out, top=25, kind=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
