"""Issue 12's table for ardit's engine: every fast path together against the plain kernels, at the
released dimensions (dummy weights, bf16, one GPU), plus an end-to-end projection for the 32-layer
model and the bf16 reuse-vs-recompute check on the tiny model.

    python3 benchmarks/fast_paths.py --layers 2 --out $OUT/kernels.json

"plain" is `ARDIT_KERNELS=plain` (SDPA with dense masks, grouped-GEMM MoE, eager decode, no
compile); "fast" is the default on CUDA bf16 (`auto`: flex attention with block masks, fused MoE
dispatch, CUDA-graph decode, compiled DiT layers). Per-layer times are a stack's time divided by
its layer count (medians of CUDA-event timings after warm-up). The per-kernel benchmarks
(attention_kernels.py, moe_kernels.py, decode_kernels.py, fp8_moe.py) go deeper on each part.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from benchmarks.engine_layers import AR_KV, AR_PREFILL, IMAGE, PREFIX, build_stack, check_tiny_reuse, cuda_time
from components.engine import kernels
from components.engine.kernels import attention as flex_kernels
from components.engine.transformer import HeadMask, SlotMask, attend

COND = (60, 60 + 3952 + 1 + 1024)  # one conditioning image: VAE 76x52 + sep + ViT slots
VLLM_OMNI_IMG_PER_GPU_HOUR = 168  # IT2I, 8 steps, 4xH100 (anchors.md)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sequence_mask(total: int, gen_start: int, batch: int = 2, q_from: int = 0) -> SlotMask:
    """Slots [q_from, total) over [0, total): causal text, the conditioning image and the generated
    image as full blocks."""
    blocks = torch.full((total,), -1, dtype=torch.long)
    blocks[COND[0]:COND[1]] = 0
    blocks[gen_start:] = 1
    slots = torch.arange(total)
    return SlotMask(slots[q_from:].expand(batch, -1), slots.expand(batch, -1), blocks[q_from:].expand(batch, -1),
                    blocks.expand(batch, -1)).to("cuda")


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ a, warmup=3, repeat=10)
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(big)
    copy_ms = cuda_time(lambda: out.copy_(big), warmup=2, repeat=5)
    return {"matmul_tflops": 2 * 8192 ** 3 / ms / 1e9, "copy_gbps": 2 * big.numel() / copy_ms / 1e6}


@torch.no_grad()
def attention_alone() -> dict:
    total = PREFIX + 1 + IMAGE
    q = torch.randn(2, 32, total, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 8, total, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = sequence_mask(total, PREFIX + 1)
    out = {}
    for mode in ("plain", "fast"):
        kernels.configure(mode)
        out[f"{mode}_ms"] = cuda_time(lambda: attend(q, k, v, mask))
        out[f"{mode}_out"] = attend(q, k, v, mask)
    out["fast_vs_plain_rel"] = rel(out.pop("fast_out"), out.pop("plain_out"))
    causal = torch.nn.functional.scaled_dot_product_attention
    out["causal_sdpa_ms"] = cuda_time(lambda: causal(q, k, v, is_causal=True, enable_gqa=True))
    return out


@torch.no_grad()
def dit_steps(model) -> dict:
    n, hidden, total = model.config.num_hidden_layers, model.config.hidden_size, PREFIX + 1 + IMAGE
    pos = torch.arange(total, dtype=torch.float64).view(1, -1, 1).expand(2, -1, 2).cuda()
    x_full = torch.randn(2, total, hidden, device="cuda", dtype=torch.bfloat16)
    x_prefix, x_step = x_full[:, :PREFIX], x_full[:, PREFIX:].contiguous()
    prefix_mask = sequence_mask(PREFIX, total)  # the generated block starts after the prefix
    step_mask = HeadMask(sequence_mask(total, PREFIX + 1, q_from=PREFIX).dense()[:, :, :1], rows=1)
    cache = model.new_cache(2, total)
    res: dict = {}
    outs: dict = {}
    for mode in ("plain", "fast"):
        kernels.configure(mode)
        compiled = mode == "fast"

        def one_forward():
            return model.forward_layers(x_full, pos, sequence_mask(total, PREFIX + 1), None, compiled=compiled)

        def prefill():
            cache.length = 0
            model.forward_layers(x_prefix, pos[:, :PREFIX], prefix_mask, cache)
            cache.commit()

        def step():
            return model.forward_layers(x_step, pos[:, PREFIX:], step_mask, cache, compiled=compiled)

        with model.autocast():
            t0 = time.perf_counter()
            one_forward()
            prefill()
            step()
            torch.cuda.synchronize()
            res[f"{mode}_warmup_s"] = round(time.perf_counter() - t0, 1)  # compiles, for fast
            res[f"{mode}_first_step_one_forward_ms"] = cuda_time(one_forward) / n
            res[f"{mode}_prefix_prefill_ms"] = cuda_time(prefill) / n
            prefill()
            res[f"{mode}_cached_step_ms"] = cuda_time(step) / n
            outs[mode] = step().clone()
        res[f"{mode}_first_step_split_ms"] = res[f"{mode}_prefix_prefill_ms"] + res[f"{mode}_cached_step_ms"]
    res["cached_step_fast_vs_plain_rel"] = rel(outs["fast"], outs["plain"])
    layer = model.model.layers[0]
    q_flops = 2 * 2 * (1 + IMAGE) * 4096 * (32 + 16) * 128 + 2 * 2 * (1 + IMAGE) * 4096 * 4096  # qkv + o
    attn_flops = 4 * 2 * 32 * (1 + IMAGE) * total * 128
    moe = layer.mlp
    expert_flops = 2 * 2 * (1 + IMAGE) * 4096 * 3 * 3072 * (moe.top_k + 1)  # routed + shared
    res["cached_step_tflop"] = (q_flops + attn_flops + expert_flops) / 1e12
    return res


@torch.no_grad()
def moe_dit_shape(model) -> dict:
    moe = model.model.layers[0].mlp
    x = torch.randn(2 * (1 + IMAGE), model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    w1, w2 = moe.experts.gate_and_up_proj, moe.experts.down_proj
    from components.engine.kernels.moe import sort_by_expert
    from components.engine.transformer import _swiglu

    _, e = moe.route(x)
    _, token, offs = sort_by_expert(e, w1.shape[0])
    xs = x[token]
    h = _swiglu(torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs))
    res = {"tokens": x.shape[0]}
    res["bare_gemms_ms"] = cuda_time(lambda: (torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs),
                                              torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)))
    res["shared_expert_ms"] = cuda_time(lambda: moe.shared_mlp(x))
    outs = {}
    for mode in ("plain", "fast"):
        kernels.configure(mode)
        res[f"{mode}_ms"] = cuda_time(lambda: moe(x))
        outs[mode] = moe(x)
        res[f"{mode}_overhead_pct"] = 100 * (res[f"{mode}_ms"] - res["bare_gemms_ms"] - res["shared_expert_ms"]) \
            / res["bare_gemms_ms"]
    res["fast_vs_plain_rel"] = rel(outs["fast"], outs["plain"])
    return res


@torch.no_grad()
def decode(model, batches: list[int], copy_gbps: float) -> dict:
    from benchmarks.decode_kernels import floor_bytes
    from components.engine.kernels.decode import StaticDecoder

    cfg, n = model.config, model.config.num_hidden_layers
    res: dict = {}
    for b in batches:
        r: dict = {}
        cache = model.new_cache(b, AR_KV + 64, rows=b)
        for t in cache.k_rows + cache.v_rows:
            t[:, :, :AR_KV].normal_()
        cache.length = AR_KV
        ids = torch.randint(0, cfg.vocab_size, (b,), device="cuda")
        x = model.embed_ids(ids.view(b, 1))
        pos = torch.full((b, 1, 2), float(AR_KV), dtype=torch.float64, device="cuda")
        with model.autocast():
            kernels.configure("plain")

            def plain():
                cache.length = AR_KV
                mask = torch.ones(b, 1, 1, AR_KV + 1, dtype=torch.bool).to("cuda")
                return model.forward_layers(x, pos, mask, cache)

            r["plain_ms"] = cuda_time(plain, warmup=3, repeat=10) / n
            h_plain = plain()[:, -1].clone()
            kernels.configure("fast")
            valid = torch.zeros(b, cache.capacity, dtype=torch.bool)
            valid[:, :AR_KV] = True
            cache.length = AR_KV
            dec = StaticDecoder(model, cache, valid, [0] * b, 0, graphs=True)
            dec.set_inputs(ids.tolist())
            span = dec.span(AR_KV)
            graph, out = StaticDecoder.capture(lambda: dec.layers(span))
            graph.replay()
            r["fast_graph_ms"] = cuda_time(graph.replay, warmup=3, repeat=20) / n
            r["fast_vs_plain_rel"] = rel(out[:, -1], h_plain)
        # the bytes a decode step must read per layer (the stored weights: FP8 ones count one byte)
        r["floor_ms"] = floor_bytes(model, b, AR_KV) / copy_gbps / 1e6
        r["fast_pct_of_floor"] = 100 * r["floor_ms"] / r["fast_graph_ms"]
        r["plain_pct_of_floor"] = 100 * r["floor_ms"] / r["plain_ms"]
        res[f"b{b}"] = r
        del dec, cache, graph, out
        torch.cuda.empty_cache()
    return res


def ar_prefill(model) -> dict:
    n = model.config.num_hidden_layers
    x = torch.randn(1, AR_PREFILL, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(AR_PREFILL, dtype=torch.float64).view(1, -1, 1).expand(1, -1, 2).cuda()
    mask = sequence_mask(AR_PREFILL, AR_PREFILL, batch=1)  # the conditioning image block, causal text
    cache = model.new_cache(1, AR_PREFILL)
    res = {}
    for mode in ("plain", "fast"):
        kernels.configure(mode)

        def run():
            cache.length = 0
            model.forward_layers(x, pos, mask, cache)

        with torch.no_grad(), model.autocast():
            res[f"{mode}_ms"] = cuda_time(run) / n
    return res


def tiny_reuse() -> dict:
    """bf16 reuse vs recompute on the tiny model (T2I and IT2I), per kernel choice: the exported
    K/V of decoded tokens written by the graph decode or again by a prefill chunk (ar.py)."""
    from components.engine import ar

    out = {}
    variants = (("plain", "plain", True, True), ("fast", "fast", True, True),
                ("fast_decode_kv_from_graphs", "fast", True, False), ("fast_causal_flex", "fast", False, True),
                ("fast_plain_decode", "fast,decode_graphs=off", True, True))
    for name, spec, causal_sdpa, prefill_decoded in variants:
        kernels.configure(spec)
        flex_kernels.CAUSAL_SDPA, ar.PREFILL_DECODED_KV = causal_sdpa, prefill_decoded
        out[name] = check_tiny_reuse("bfloat16")
    flex_kernels.CAUSAL_SDPA, ar.PREFILL_DECODED_KV = True, True
    return out


@torch.no_grad()
def prefill_decoded_cost(model, batch: int = 64, tokens: int = 256) -> dict:
    """ARScheduler._write_decoded at full size (batched): one chunk of `tokens` CoT tokens per row over the cached
    prompt, per layer, next to the decode steps that produced them."""
    n, hidden = model.config.num_hidden_layers, model.config.hidden_size
    end = AR_KV + tokens
    cache = model.new_cache(batch, end)
    for t in cache.k + cache.v:
        t[:, :, :AR_KV].normal_()
    slots = torch.arange(end)
    no_block = torch.full((batch, end), -1)
    mask = SlotMask(slots[AR_KV:].expand(batch, -1), slots.expand(batch, -1), no_block[:, AR_KV:], no_block).to("cuda")
    x = torch.randn(batch, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    pos = slots[AR_KV:].to(torch.float64).view(1, -1, 1).expand(batch, -1, 2).cuda()

    def chunk():
        cache.length = AR_KV
        model.forward_layers(x, pos, mask, cache)

    kernels.configure("fast")
    with model.autocast():
        ms = cuda_time(chunk) / n
    return {"batch": batch, "tokens": tokens, "chunk_ms_per_layer": ms}


def projection(r: dict, cot_tokens: int, decode_batch: int, vae_s: float) -> dict:
    """Seconds per IT2I image on one GPU from per-layer times x 32 layers: AR prefill + CoT decode
    (the row's share of a batch) + DiT first step + cached steps + VAE decode."""
    layers = 32
    out = {"cot_tokens": cot_tokens, "decode_batch": decode_batch, "vae_decode_s": vae_s}
    for mode, decode_key in (("plain", "plain_ms"), ("fast", "fast_graph_ms")):
        ar = layers * r["ar_prefill"][f"{mode}_ms"] / 1e3
        dec = cot_tokens * layers * r["decode"][f"b{decode_batch}"][decode_key] / 1e3 / decode_batch
        first = layers * r["dit"][f"{mode}_first_step_split_ms"] / 1e3
        step = layers * r["dit"][f"{mode}_cached_step_ms"] / 1e3
        for steps in (8, 50):
            seconds = ar + dec + first + (steps - 1) * step + vae_s
            out[f"{mode}_{steps}_steps_s"] = round(seconds, 2)
            out[f"{mode}_{steps}_steps_img_per_gpu_hour"] = round(3600 / seconds, 1)
    out["vs_vllm_omni_8_steps"] = round(out["fast_8_steps_img_per_gpu_hour"] / VLLM_OMNI_IMG_PER_GPU_HOUR, 2)
    return out


def table(r: dict) -> str:
    d, m, a = r.get("dit", {}), r.get("moe", {}), r.get("attention", {})
    dec = r.get("decode", {})
    rows = [
        ("DiT cached step (2 x 3954 over 6796)", d.get("plain_cached_step_ms"), d.get("fast_cached_step_ms"), "<= 13"),
        ("DiT first step (prefill + first step)", d.get("plain_first_step_split_ms"),
         d.get("fast_first_step_split_ms"), "<= 30"),
        ("DiT first step as one forward", d.get("plain_first_step_one_forward_ms"),
         d.get("fast_first_step_one_forward_ms"), ""),
        ("masked attention 2 x 10750", a.get("plain_ms"), a.get("fast_ms"), "<= 7"),
        ("MoE at DiT shape", m.get("plain_ms"), m.get("fast_ms"),
         f"GEMMs {m.get('bare_gemms_ms', 0):.2f} + shared {m.get('shared_expert_ms', 0):.2f}"),
        ("  overhead over the GEMMs (%)", m.get("plain_overhead_pct"), m.get("fast_overhead_pct"), "<= 10 %"),
        ("AR prefill 6690", r.get("ar_prefill", {}).get("plain_ms"), r.get("ar_prefill", {}).get("fast_ms"), ""),
    ]
    for b, r_b in dec.items():
        rows.append((f"AR decode {b}, KV 6.8k", r_b.get("plain_ms"), r_b.get("fast_graph_ms"),
                     f"floor {r_b.get('floor_ms', 0):.2f} ({r_b.get('fast_pct_of_floor', 0):.0f} %)"))
    lines = [f"{'per layer (ms)':44} {'plain':>8} {'fast':>8}  goal / note"]
    for name, p, f, goal in rows:
        fmt = lambda v: f"{v:8.2f}" if isinstance(v, (int, float)) else f"{'-':>8}"  # noqa: E731
        lines.append(f"{name:44} {fmt(p)} {fmt(f)}  {goal}")
    if "prefill_decoded" in r:
        c = r["prefill_decoded"]
        lines.append(f"{'CoT K/V again as a prefill chunk (b64 x 256)':44} {'':>8} {c['chunk_ms_per_layer']:8.2f}  "
                     f"vs 256 decode steps {256 * dec.get('b64', {}).get('fast_graph_ms', float('nan')):.0f} ms")
    for name, variant in r.get("tiny", {}).items():
        t2i, it2i = variant.get("bfloat16_t2i", {}), variant.get("bfloat16_it2i", {})
        lines.append(f"tiny bf16 reuse vs recompute, {name:28} T2I {t2i.get('psnr_db', float('nan')):6.1f} dB "
                     f"({t2i.get('kv_path')}), IT2I {it2i.get('psnr_db', float('nan')):6.1f} dB ({it2i.get('kv_path')})")
    if "projection" in r:
        p = r["projection"]
        lines.append(f"projection (one GPU, {p['cot_tokens']} CoT tokens at decode batch {p['decode_batch']}): "
                     f"8 steps {p['plain_8_steps_img_per_gpu_hour']} -> {p['fast_8_steps_img_per_gpu_hour']} img/GPU-h "
                     f"({p['vs_vllm_omni_8_steps']}x vLLM-Omni's {VLLM_OMNI_IMG_PER_GPU_HOUR}); 50 steps "
                     f"{p['plain_50_steps_img_per_gpu_hour']} -> {p['fast_50_steps_img_per_gpu_hour']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cot-tokens", type=int, default=0, help="CoT tokens per image in the projection")
    parser.add_argument("--decode-batch", type=int, default=64, choices=(1, 64))
    parser.add_argument("--vae-s", type=float, default=0.48, help="VAE decode seconds (measured: full_model.py)")
    parser.add_argument("--skip", default="",
                        help="comma list: ceilings,attention,dit,moe,ar_prefill,decode,prefill_decoded,tiny")
    parser.add_argument("--quantization", default="", help="fp8: the stack's linears and experts in FP8")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    info: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                  "date": time.strftime("%Y-%m-%d"), "errors": {}}
    previous = kernels.settings()

    def section(name: str, fn, *a) -> None:
        if name in skip:
            return
        t0 = time.time()
        try:
            info[name] = fn(*a)
        except Exception:  # noqa: BLE001 - one failed section is reported, the others still run
            info["errors"][name] = traceback.format_exc()[-3000:]
        finally:
            kernels.configure(previous)
        print(name, f"{time.time() - t0:.1f}s", json.dumps(info.get(name, info["errors"].get(name)))[:1500],
              flush=True)

    section("ceilings", ceilings)
    section("attention", attention_alone)
    model = build_stack(args.layers)
    if args.quantization == "fp8":
        from components.engine.quant import quantize_model_fp8_

        quantize_model_fp8_(model)
        info["quantization"] = "fp8"
    section("dit", dit_steps, model)
    section("moe", moe_dit_shape, model)
    section("ar_prefill", ar_prefill, model)
    section("decode", decode, model, [1, 64], info.get("ceilings", {}).get("copy_gbps", 3000.0))
    section("prefill_decoded", prefill_decoded_cost, model)
    del model
    torch.cuda.empty_cache()
    section("tiny", tiny_reuse)
    if all(k in info for k in ("dit", "decode", "ar_prefill")):
        info["projection"] = projection(info, args.cot_tokens, args.decode_batch, args.vae_s)
        info["projection_cot_256"] = projection(info, 256, args.decode_batch, args.vae_s)
    info["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1, default=str)
    print(table(info))


if __name__ == "__main__":
    main()
