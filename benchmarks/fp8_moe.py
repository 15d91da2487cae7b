"""FP8 (W8A8, rowwise) against bf16 on one Hopper GPU, at full HunyuanImage-3 dimensions: checks
first, then timings, in one call (~3-4 minutes on an H100).

    python benchmarks/fp8_moe.py --out $OUT/fp8_moe.json

1. ceilings: a large bf16 matmul, a large rowwise-FP8 `_scaled_mm`, a device-to-device copy;
2. correctness on fresh random inputs: compiled vs eager activation quantization (bitwise), fused
   FP8 (`_scaled_mm` / `_scaled_grouped_mm`) vs the fp32 dequantizing reference of
   `components.engine.quant` (dense, experts with router, skewed and decode routings), FP8 vs bf16;
   `build_model_fp8` (meta -> FP8 -> dummy weights) bitwise equal to quantizing the bf16 layer;
3. timings (CUDA events, median): bare grouped GEMMs, activation quantization, routed experts,
   the whole MoE, qkv/o projections and one whole decoder layer, at the DiT cached-step shape
   (2 x 3 954 tokens over a 6 796-token prefix) and AR decode at batch 1 / 8 / 64 (KV 6 800);
4. the tiny engine on the GPU in bf16: image PSNR of FP8 fused vs FP8 reference vs bf16 (needs
   diffusers/transformers; skipped with a note when missing).
Prints a short table last; full numbers in the JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import traceback

import torch

from benchmarks.engine_layers import cuda_time
from components.engine import quant
from components.engine.config import get_config
from components.engine.kernels.compiled import call_compiled, compile_failures
from components.engine.quant import (
    Fp8Experts,
    Fp8Linear,
    fp8_linear_fused,
    fp8_linear_reference,
    fp8_moe_fused,
    fp8_moe_reference,
    quantize_model_fp8_,
    quantize_rowwise,
    swiglu_quantize_rowwise,
    weight_bytes,
)
from components.engine.transformer import DecoderLayer, HeadMask, KVCache, _swiglu, moe_grouped, rope_cos_sin
from components.engine.engine import build_model, build_model_fp8, materialize

DIT_TOKENS = 2 * (1 + 3953)  # CFG rows x (<timestep> + 76 x 52 image tokens): the cached step
PREFIX, AR_KV = 6796, 6800
DECODE = (1, 8, 64)
T0 = time.time()
DEVICE = "cuda"  # module globals, so a CPU smoke run of the plumbing can shrink them
CFG = get_config("hunyuan-image-3")
H, I = CFG.hidden_size, CFG.layer("moe_intermediate_size", 0)
CEILING_N, COPY_BYTES = 8192, 1 << 30


def cuda_ms(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds of fn() with CUDA events around each call."""
    return cuda_time(fn, warmup=warmup, repeat=repeat)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.float()).all())


def randn(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    # rows of different magnitude, so per-row scales matter
    x = torch.randn(*shape, device=DEVICE, dtype=torch.float32)
    x *= torch.exp(torch.randn(*shape[:-1], 1, device=DEVICE))
    return x.to(dtype)


def uniform_routing(n: int, num_experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    experts = torch.rand(n, num_experts, device=DEVICE).topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(n, k, device=DEVICE), -1)
    return weights, experts


def guarded(results: dict, key: str, fn):
    """Run one section; an exception is recorded (with its traceback) instead of ending the run."""
    try:
        results[key] = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark reports every failure and carries on
        results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(f"[{time.time() - T0:6.1f}s] {key}: {json.dumps(results[key], default=str)[:600]}", flush=True)
    return results[key]


# -- building one full-size layer ----------------------------------------------------------------
def build_layer(cfg, seed: int = 0) -> DecoderLayer:
    """Decoder layer 0 of the engine's bf16 model with dummy weights (a one-layer model is built)."""
    net = build_model(cfg.replace(num_hidden_layers=1), DEVICE, allocate=False)
    materialize(net, DEVICE, None, seed)
    return net.model.layers[0].eval()


# -- sections -------------------------------------------------------------------------------------
def ceilings() -> dict:
    n = CEILING_N
    a, b = randn(n, n), randn(n, n)
    bf16 = cuda_ms(lambda: a @ b.T)
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b)
    f8 = cuda_ms(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa[:, None], scale_b=sb[None, :],
                                          out_dtype=torch.bfloat16))
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src))
    return {"bf16_mm_tflops": 2 * n ** 3 / bf16 / 1e9, "fp8_rowwise_mm_tflops": 2 * n ** 3 / f8 / 1e9,
            "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def check_quantize_kernels() -> dict:
    out = {}
    x = randn(DIT_TOKENS, H)
    q1, s1 = call_compiled(quantize_rowwise, x)
    q2, s2 = quantize_rowwise(x)
    out["quantize_x_bitwise_equal"] = bool(torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
                                           and torch.equal(s1, s2))
    out["quantize_x_mismatch_fraction"] = (q1.view(torch.uint8) != q2.view(torch.uint8)).float().mean().item()
    h = randn(4096, 2 * I)
    q1, s1 = call_compiled(swiglu_quantize_rowwise, h)
    q2, s2 = swiglu_quantize_rowwise(h)
    out["swiglu_quantize_mismatch_fraction"] = (q1.view(torch.uint8) != q2.view(torch.uint8)).float().mean().item()
    out["swiglu_quantize_scale_rel"] = rel(s1, s2)
    return out


def check_dense(layer: DecoderLayer, layer8: DecoderLayer) -> dict:
    out = {}
    for name in ("qkv_proj", "o_proj"):
        lin, f8 = getattr(layer.self_attn, name), getattr(layer8.self_attn, name)
        x = randn(4096, lin.in_features)
        ref = fp8_linear_reference(x, f8.weight, f8.weight_scale)
        fused = fp8_linear_fused(x, f8.weight, f8.weight_scale)
        row = {"fused_vs_reference": rel(fused, ref), "fp8_vs_bf16": rel(fused, lin(x)), "finite": finite(fused)}
        try:
            row["fast_accum_vs_reference"] = rel(fp8_linear_fused(x, f8.weight, f8.weight_scale, use_fast_accum=True), ref)
        except Exception as e:  # noqa: BLE001
            row["fast_accum_vs_reference"] = f"{type(e).__name__}: {e}"[:200]
        x1 = randn(1, lin.in_features)
        row["decode1_fused_vs_reference"] = rel(fp8_linear_fused(x1, f8.weight, f8.weight_scale),
                                                fp8_linear_reference(x1, f8.weight, f8.weight_scale))
        out[name] = row
    return out


def _experts_args(e8: Fp8Experts):
    return e8.gate_and_up_proj, e8.gate_and_up_proj_scale, e8.down_proj, e8.down_proj_scale


def check_experts(layer: DecoderLayer, layer8: DecoderLayer) -> dict:
    moe, e8 = layer.mlp, layer8.mlp.experts
    w8 = _experts_args(e8)
    out = {}
    cases = {}
    x = randn(2048, H)
    cases["router_2048"] = (x, *moe.route(x))
    xs = randn(64, H)
    # every token on experts 0..k-1 in random slot order: all other groups empty
    k = moe.top_k
    skew = torch.stack([torch.randperm(k, device=DEVICE) for _ in range(64)])
    cases["skewed_64_topk_experts"] = (xs, torch.softmax(torch.randn(64, k, device=DEVICE), -1), skew)
    x1 = randn(1, H)
    cases["decode_1"] = (x1, *moe.route(x1))
    for name, (xx, w, e) in cases.items():
        ref = fp8_moe_reference(xx, w, e, *w8)
        row = {}
        for combine in ("compiled", "bmm"):
            fused = fp8_moe_fused(xx, w, e, *w8, combine=combine)
            row[f"fused_{combine}_vs_reference"] = rel(fused, ref)
            row["finite"] = row.get("finite", True) and finite(fused)
        try:
            row["fast_accum_vs_reference"] = rel(fp8_moe_fused(xx, w, e, *w8, use_fast_accum=True), ref)
        except Exception as e_:  # noqa: BLE001
            row["fast_accum_vs_reference"] = f"{type(e_).__name__}: {e_}"[:200]
        bf16 = moe_grouped(xx, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj)
        row["fp8_vs_bf16"] = rel(ref, bf16)
        out[name] = row
    return out


def check_builder(cfg, layer8: DecoderLayer) -> dict:
    """build_model_fp8 on the GPU (2 layers): layer 0 bitwise equal to quantizing the bf16 dummy
    layer; peak memory against the FP8 bytes (the bf16 model never exists whole)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model_fp8(cfg.replace(num_hidden_layers=2), DEVICE, seed=0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    a, b = model.model.layers[0].state_dict(), layer8.state_dict()
    same = a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8) if a[k].dtype == quant.FP8 else a[k],
                    b[k].view(torch.uint8) if b[k].dtype == quant.FP8 else b[k]) for k in a)
    out = {"layer0_bitwise_equal_to_quantized_bf16": bool(same), "model_gb": weight_bytes(model) / 1e9,
           "fp8_layer_gb": weight_bytes(model.model.layers[0]) / 1e9, "peak_gb": peak / 1e9}
    del model
    torch.cuda.empty_cache()
    return out


def time_gemms(layer: DecoderLayer, layer8: DecoderLayer, n_tokens: int) -> dict:
    """Bare grouped GEMMs on inputs already in expert order, uniform routing."""
    moe, e8 = layer.mlp, layer8.mlp.experts
    k, e_ = moe.top_k, moe.num_experts
    w, e = uniform_routing(n_tokens, e_, k)
    order, token, offs = quant.sort_by_expert(e, e_)
    w1, w2 = moe.experts.gate_and_up_proj, moe.experts.down_proj
    xs = randn(n_tokens, H)[token]
    h = _swiglu(torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs))
    bf16 = cuda_ms(lambda: (torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs),
                            torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)))
    qx, sx = quantize_rowwise(xs)
    qh, sh = quantize_rowwise(h)
    q1, s1, q2, s2 = _experts_args(e8)

    def fp8(fast=False):
        torch._scaled_grouped_mm(qx, q1.transpose(1, 2), sx, s1, offs=offs, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)
        torch._scaled_grouped_mm(qh, q2.transpose(1, 2), sh, s2, offs=offs, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)

    f8 = cuda_ms(fp8)
    flops = 6 * n_tokens * k * H * I
    active = int((torch.bincount(e.reshape(-1), minlength=e_) > 0).sum())
    out = {"bf16_ms": bf16, "fp8_ms": f8, "speedup": bf16 / f8, "bf16_tflops": flops / bf16 / 1e9,
           "fp8_tflops": flops / f8 / 1e9, "active_experts": active,
           "fp8_weight_gbps": active * 3 * H * I / f8 / 1e6}
    try:
        out["fp8_fast_accum_ms"] = cuda_ms(lambda: fp8(True))
    except Exception as ex:  # noqa: BLE001
        out["fp8_fast_accum_ms"] = f"{type(ex).__name__}: {ex}"[:200]
    if n_tokens == DIT_TOKENS:
        out["quantize_x_compiled_ms"] = cuda_ms(lambda: call_compiled(quantize_rowwise, xs[:n_tokens]))
        out["swiglu_quantize_compiled_ms"] = cuda_ms(
            lambda: call_compiled(swiglu_quantize_rowwise, torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)))
        out["first_gemm_alone_bf16_ms"] = cuda_ms(lambda: torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs))
        out["swiglu_quantize_eager_ms"] = cuda_ms(lambda: swiglu_quantize_rowwise(h))
        out["swiglu_quantize_compiled_only_ms"] = cuda_ms(lambda: call_compiled(swiglu_quantize_rowwise, h))
        out["swiglu_bf16_ms"] = cuda_ms(lambda: _swiglu(h))
    return out


def time_moe(layer: DecoderLayer, layer8: DecoderLayer, n_tokens: int) -> dict:
    """Routed experts (given uniform routing) and the whole MoE module (router, shared, routed)."""
    moe, moe8 = layer.mlp, layer8.mlp
    w, e = uniform_routing(n_tokens, moe.num_experts, moe.top_k)
    x = randn(n_tokens, H)
    w8 = _experts_args(moe8.experts)
    out = {"routed_bf16_ms": cuda_ms(lambda: moe_grouped(x, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj))}
    out["routed_fp8_ms"] = cuda_ms(lambda: fp8_moe_fused(x, w, e, *w8))
    out["routed_fp8_bmm_combine_ms"] = cuda_ms(lambda: fp8_moe_fused(x, w, e, *w8, combine="bmm"))
    try:
        out["routed_fp8_fast_accum_ms"] = cuda_ms(lambda: fp8_moe_fused(x, w, e, *w8, use_fast_accum=True))
    except Exception as ex:  # noqa: BLE001
        out["routed_fp8_fast_accum_ms"] = f"{type(ex).__name__}: {ex}"[:200]
    xb = x.view(1, n_tokens, H)
    out["moe_bf16_ms"] = cuda_ms(lambda: moe(xb))
    out["moe_fp8_ms"] = cuda_ms(lambda: moe8(xb))
    out["moe_speedup"] = out["moe_bf16_ms"] / out["moe_fp8_ms"]
    out["moe_bf16_again_ms"] = cuda_ms(lambda: moe(xb))  # the same version twice: the noise
    out["moe_fp8_rel_to_bf16"] = rel(moe8(xb), moe(xb))
    return out


def time_dense(layer: DecoderLayer, layer8: DecoderLayer, n_tokens: int) -> dict:
    out = {}
    for name in ("qkv_proj", "o_proj"):
        lin, f8 = getattr(layer.self_attn, name), getattr(layer8.self_attn, name)
        x = randn(n_tokens, lin.in_features)
        out[f"{name}_bf16_ms"] = cuda_ms(lambda: lin(x))
        out[f"{name}_fp8_ms"] = cuda_ms(lambda: f8(x))
        out[f"{name}_speedup"] = out[f"{name}_bf16_ms"] / out[f"{name}_fp8_ms"]
    return out


def time_layer(layer: DecoderLayer, layer8: DecoderLayer, cfg) -> dict:
    out = {}
    hd = cfg.attention_head_dim
    # DiT cached step: <timestep> + image tokens of both CFG rows over the cached prefix
    t = DIT_TOKENS // 2
    cache = KVCache(1, 2, cfg.num_key_value_heads, hd, PREFIX + t, torch.bfloat16, DEVICE)
    for buf in (cache.k[0], cache.v[0]):
        buf.normal_()
    cache.length = PREFIX
    pos = torch.arange(PREFIX, PREFIX + t, device=DEVICE, dtype=torch.float64).view(1, t, 1).expand(2, t, 2)
    cos, sin = rope_cos_sin(pos, hd, cfg.rope_theta)
    row = (torch.arange(PREFIX + t, device=DEVICE) <= PREFIX).view(1, 1, 1, -1).expand(2, 1, 1, -1)
    mask = HeadMask(row, rows=1)
    x = randn(2, t, H)
    for label, lyr in (("bf16", layer), ("fp8", layer8)):
        out[f"dit_cached_step_{label}_ms"] = cuda_ms(lambda: lyr(x, cos, sin, mask, cache, 0))
    out["dit_cached_step_speedup"] = out["dit_cached_step_bf16_ms"] / out["dit_cached_step_fp8_ms"]
    del cache
    for b in DECODE:
        cache = KVCache(1, b, cfg.num_key_value_heads, hd, AR_KV + 1, torch.bfloat16, DEVICE)
        for buf in (cache.k[0], cache.v[0]):
            buf.normal_()
        cache.length = AR_KV
        pos = torch.full((b, 1, 2), float(AR_KV), device=DEVICE, dtype=torch.float64)
        cos, sin = rope_cos_sin(pos, hd, cfg.rope_theta)
        mask = torch.ones(b, 1, 1, AR_KV + 1, dtype=torch.bool, device=DEVICE)
        x = randn(b, 1, H)
        for label, lyr in (("bf16", layer), ("fp8", layer8)):
            out[f"decode_b{b}_{label}_ms"] = cuda_ms(lambda: lyr(x, cos, sin, mask, cache, 0), warmup=5, repeat=20)
        out[f"decode_b{b}_speedup"] = out[f"decode_b{b}_bf16_ms"] / out[f"decode_b{b}_fp8_ms"]
        del cache
    return out


def tiny_end_to_end() -> dict:
    """Tiny engine, bf16 on the GPU: FP8 fused vs FP8 reference vs bf16, one T2I and one IT2I row."""
    import numpy as np
    from PIL import Image

    from components.engine import ARRequest, DiTRequest, Engine, SamplingParams

    def psnr(a, b):
        a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
        mse = ((a - b) ** 2).mean()
        return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)

    eng = Engine.load("tiny", device=DEVICE, dtype="bfloat16")
    eng8 = Engine.load("tiny", device=DEVICE, dtype="bfloat16", quantization="fp8")  # the engine's own FP8 load
    cond = Image.fromarray((np.random.RandomState(0).rand(96, 160, 3) * 255).astype("uint8"))
    out = {}
    for name, images in (("t2i", []), ("it2i", [cond])):
        ar = eng.generate_ar([ARRequest(name, "make the sky purple", images)], SamplingParams(max_new_tokens=16))[0]
        req = DiTRequest(ar, images, None, steps=8, seed=1)
        bf16 = eng.dit(req)
        fused = eng8.dit(req)
        Fp8Linear.impl = Fp8Experts.impl = "reference"
        try:
            ref = eng8.dit(req)
        finally:
            Fp8Linear.impl = Fp8Experts.impl = "auto"
        out[name] = {"fused_vs_reference_psnr": psnr(fused.image, ref.image),
                     "fused_vs_reference_latent_rel": rel(fused.latents, ref.latents),
                     "fp8_vs_bf16_psnr": psnr(fused.image, bf16.image),
                     "fp8_vs_bf16_latent_rel": rel(fused.latents, bf16.latents)}
    return out


def table(res: dict) -> str:
    lines = []

    def num(v, fmt="{:.3f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "ERR"

    c = res.get("ceilings", {})
    lines.append(f"ceilings: bf16 mm {num(c.get('bf16_mm_tflops'), '{:.0f}')} TFLOP/s, fp8 rowwise mm "
                 f"{num(c.get('fp8_rowwise_mm_tflops'), '{:.0f}')} TFLOP/s, copy {num(c.get('copy_gbps'), '{:.0f}')} GB/s")
    lines.append(f"{'work':44s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'x':>6s}  target")
    for n in (DIT_TOKENS, *DECODE):
        tag = "DiT 2x3954" if n == DIT_TOKENS else f"decode b{n}"
        g = res.get(f"gemms_{n}", {})
        if "bf16_ms" in g:
            lines.append(f"{'bare grouped GEMMs, ' + tag:44s} {g['bf16_ms']:9.3f} {g['fp8_ms']:9.3f} {g['speedup']:6.2f}")
        m = res.get(f"moe_{n}", {})
        if "moe_bf16_ms" in m:
            target = 1.3 if n == DIT_TOKENS else 2.0
            ok = "ok" if m["moe_speedup"] >= target else "MISS"
            lines.append(f"{'routed experts, ' + tag:44s} {m['routed_bf16_ms']:9.3f} {m['routed_fp8_ms']:9.3f} "
                         f"{m['routed_bf16_ms'] / m['routed_fp8_ms']:6.2f}")
            lines.append(f"{'whole MoE, ' + tag:44s} {m['moe_bf16_ms']:9.3f} {m['moe_fp8_ms']:9.3f} "
                         f"{m['moe_speedup']:6.2f}  >={target} {ok}")
        d = res.get(f"dense_{n}", {})
        for name in ("qkv_proj", "o_proj"):
            if f"{name}_bf16_ms" in d:
                lines.append(f"{name + ', ' + tag:44s} {d[name + '_bf16_ms']:9.3f} {d[name + '_fp8_ms']:9.3f} "
                             f"{d[name + '_speedup']:6.2f}")
    lay = res.get("layer", {})
    if "dit_cached_step_bf16_ms" in lay:
        lines.append(f"{'decoder layer, DiT cached step':44s} {lay['dit_cached_step_bf16_ms']:9.3f} "
                     f"{lay['dit_cached_step_fp8_ms']:9.3f} {lay['dit_cached_step_speedup']:6.2f}")
        for b in DECODE:
            if f"decode_b{b}_bf16_ms" in lay:
                lines.append(f"{f'decoder layer, decode b{b} (KV 6800)':44s} {lay[f'decode_b{b}_bf16_ms']:9.3f} "
                             f"{lay[f'decode_b{b}_fp8_ms']:9.3f} {lay[f'decode_b{b}_speedup']:6.2f}")
    g = res.get(f"gemms_{DIT_TOKENS}", {})
    if "quantize_x_compiled_ms" in g:
        lines.append(f"quantize x {num(g['quantize_x_compiled_ms'])} ms; swiglu+quantize compiled "
                     f"{num(g['swiglu_quantize_compiled_only_ms'])} / eager {num(g['swiglu_quantize_eager_ms'])} ms "
                     f"(bf16 swiglu {num(g['swiglu_bf16_ms'])} ms)")
    checks = []
    for sec in ("check_dense", "check_experts"):
        for case, row in res.get(sec, {}).items():
            if isinstance(row, dict):
                worst = max((v for k, v in row.items() if k.startswith(("fused", "decode1")) and isinstance(v, float)),
                            default=float("nan"))
                checks.append(f"{case} {worst:.1e}")
    lines.append("fused vs reference (rel, need <= 1e-2): " + ", ".join(checks) + f"  -> {res.get('checks_pass')}")
    b = res.get("builder", {})
    lines.append(f"builder: layer0 bitwise {b.get('layer0_bitwise_equal_to_quantized_bf16')}, fp8 layer "
                 f"{num(b.get('fp8_layer_gb'), '{:.2f}')} GB, peak {num(b.get('peak_gb'), '{:.2f}')} GB for 2 layers")
    t = res.get("tiny", {})
    if "t2i" in t:
        lines.append("tiny bf16 GPU: " + "; ".join(
            f"{k} fused-vs-ref {v['fused_vs_reference_psnr']:.1f} dB, fp8-vs-bf16 {v['fp8_vs_bf16_psnr']:.1f} dB"
            for k, v in t.items()))
    elif t:
        lines.append(f"tiny: {str(t.get('error', t))[:200]}")
    lines.append(f"compile failures (ran eagerly): {res.get('compile_failures') or 'none'}")
    lines.append(f"wall {time.time() - T0:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--budget-s", type=float, default=230.0, help="skip later sections past this")
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    cfg = CFG
    res: dict = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(res), flush=True)
    torch.manual_seed(0)
    for knob in ("recompile_limit", "cache_size_limit"):  # full-size and tiny shapes in one process
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    guarded(res, "ceilings", ceilings)
    layer = build_layer(cfg)
    layer8 = copy.deepcopy(layer)
    quantize_model_fp8_(layer8)
    res["layer_gb"] = {"bf16": weight_bytes(layer) / 1e9, "fp8": weight_bytes(layer8) / 1e9}
    with torch.no_grad():
        guarded(res, "check_quantize", check_quantize_kernels)
        guarded(res, "check_dense", lambda: check_dense(layer, layer8))
        guarded(res, "check_experts", lambda: check_experts(layer, layer8))
        vals = [v for sec in ("check_dense", "check_experts") for row in res[sec].values() if isinstance(row, dict)
                for k, v in row.items() if k.startswith(("fused", "decode1")) and isinstance(v, float)]
        res["checks_pass"] = bool(vals) and all(v <= 1e-2 for v in vals) and all(
            row.get("finite", True) for sec in ("check_dense", "check_experts") for row in res[sec].values()
            if isinstance(row, dict))
        guarded(res, "builder", lambda: check_builder(cfg, layer8))
        for n in (DIT_TOKENS, *DECODE):
            guarded(res, f"gemms_{n}", lambda: time_gemms(layer, layer8, n))
            guarded(res, f"moe_{n}", lambda: time_moe(layer, layer8, n))
            guarded(res, f"dense_{n}", lambda: time_dense(layer, layer8, n))
        if time.time() - T0 < args.budget_s:
            guarded(res, "layer", lambda: time_layer(layer, layer8, cfg))
        del layer, layer8
        torch.cuda.empty_cache()
    if not args.skip_tiny and time.time() - T0 < args.budget_s:
        guarded(res, "tiny", tiny_end_to_end)
    res["compile_failures"] = dict(compile_failures)
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    res["wall_s"] = time.time() - T0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("\n" + table(res))


if __name__ == "__main__":
    main()
