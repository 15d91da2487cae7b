"""Full-dimension HunyuanImage-3 layer stack (dummy weights) on a GPU: DiT and AR timings.

Shapes follow the anchors (1216x832 IT2I): DiT CFG batch 2 x 10 750 tokens on the first step,
2 x 3 954 image tokens over a 6 796-token cached prefix on later steps, AR prefill of 6 690
tokens, AR decode with 6 800 cached tokens at batch 1 / 8 / 64. Per-layer times are the stack
time divided by the layer count. Also checks on the GPU: tiny-model reuse vs recompute (bf16) and
grouped vs per-expert MoE.

    python benchmarks/engine_layers.py --layers 4 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from components.engine.config import get_config
from components.engine.transformer import HeadMask, HunyuanImage3ForCausalMM, MoE, attention_mask, moe_grouped, moe_loop
from components.engine.weights import init_dummy_weights

PREFIX, IMAGE, AR_PREFILL, AR_KV = 6796, 3953, 6690, 6800
COND_BLOCK = (60, 60 + 3952 + 1 + 729)  # one conditioning image: VAE 76x52 + sep + ViT slots


def cuda_time(fn, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def block_ids(length: int, gen_start: int | None) -> torch.Tensor:
    ids = torch.full((length,), -1, dtype=torch.long)
    ids[COND_BLOCK[0]:COND_BLOCK[1]] = 0
    if gen_start is not None:
        ids[gen_start:] = 1
    return ids


def build_stack(layers: int) -> HunyuanImage3ForCausalMM:
    cfg = get_config("hunyuan-image-3").replace(num_hidden_layers=layers)
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(cfg, with_conditioning=False)
    model = model.to_empty(device="cuda")
    init_dummy_weights(model, seed=0)
    model = model.to(torch.bfloat16).eval()
    for m in model.modules():
        if hasattr(m, "wg"):
            m.float()
    return model


@torch.no_grad()
def time_stack(model: HunyuanImage3ForCausalMM, batches: list[int]) -> dict:
    cfg, dev = model.config, "cuda"
    n_layers = cfg.num_hidden_layers
    hidden = cfg.hidden_size
    res: dict = {}

    def rand(b, t):
        return torch.randn(b, t, hidden, device=dev, dtype=torch.bfloat16)

    # DiT first step as one forward over the whole sequence (the anchors' shape)
    total = PREFIX + 1 + IMAGE
    blocks = block_ids(total, PREFIX + 1)
    pos = torch.arange(total, dtype=torch.float64).view(1, -1, 1).expand(2, -1, 2).to(dev)
    slots = torch.arange(total).expand(2, -1)
    mask = attention_mask(slots, slots, blocks.expand(2, -1), blocks.expand(2, -1)).to(dev)
    x = rand(2, total)
    res["dit_first_step_full_ms"] = cuda_time(lambda: model.forward_layers(x, pos, mask, None)) / n_layers
    del mask

    # DiT first step as ardit runs it: prefix prefill into the cache, then the image tokens
    pblocks = blocks[:PREFIX]
    pmask = attention_mask(slots[:, :PREFIX], slots[:, :PREFIX], pblocks.expand(2, -1), pblocks.expand(2, -1)).to(dev)
    xp = rand(2, PREFIX)
    cache = model.new_cache(2, total)

    def prefill():
        cache.length = 0
        model.forward_layers(xp, pos[:, :PREFIX], pmask, cache)
        cache.commit()

    res["dit_prefix_prefill_ms"] = cuda_time(prefill) / n_layers
    prefill()
    del pmask
    q = torch.arange(PREFIX, total).expand(2, -1)
    imask = attention_mask(q, slots, blocks[PREFIX:].expand(2, -1), blocks.expand(2, -1)).to(dev)
    xi = rand(2, 1 + IMAGE)
    res["dit_cached_step_fullmask_ms"] = cuda_time(
        lambda: model.forward_layers(xi, pos[:, PREFIX:], imask, cache)) / n_layers
    # as DiTGenerator.predict runs it: only the <timestep> query carries a mask
    hmask = HeadMask(imask[:, :, :1], rows=1)
    res["dit_cached_step_ms"] = cuda_time(lambda: model.forward_layers(xi, pos[:, PREFIX:], hmask, cache)) / n_layers
    res["dit_first_step_split_ms"] = res["dit_prefix_prefill_ms"] + res["dit_cached_step_ms"]
    del cache, imask

    # AR prefill, one row
    ar_blocks = block_ids(AR_PREFILL, None)
    s = torch.arange(AR_PREFILL).expand(1, -1)
    amask = attention_mask(s, s, ar_blocks.expand(1, -1), ar_blocks.expand(1, -1)).to(dev)
    apos = torch.arange(AR_PREFILL, dtype=torch.float64).view(1, -1, 1).expand(1, -1, 2).to(dev)
    xa = rand(1, AR_PREFILL)
    acache = model.new_cache(1, AR_PREFILL)

    def ar_prefill():
        acache.length = 0
        model.forward_layers(xa, apos, amask, acache)
        acache.commit()

    res["ar_prefill_ms"] = cuda_time(ar_prefill) / n_layers
    del amask, acache

    # AR decode: one token per row over AR_KV cached tokens
    for b in batches:
        dcache = model.new_cache(b, AR_KV + 1)
        dcache.length = AR_KV
        dmask = torch.ones(b, 1, 1, AR_KV + 1, dtype=torch.bool, device=dev)
        dpos = torch.full((b, 1, 2), float(AR_KV), dtype=torch.float64, device=dev)
        xd = rand(b, 1)
        res[f"ar_decode_b{b}_ms"] = cuda_time(lambda: model.forward_layers(xd, dpos, dmask, dcache),
                                              warmup=3, repeat=10) / n_layers
        del dcache
    return res


@torch.no_grad()
def check_moe(model: HunyuanImage3ForCausalMM) -> dict:
    moe: MoE = model.model.layers[0].mlp
    x = torch.randn(4096, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, e = moe.route(x)
    a = moe_grouped(x, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj).float()
    b = moe_loop(x, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj).float()
    rel = ((a - b).norm() / b.norm()).item()
    tg = cuda_time(lambda: moe_grouped(x, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj))
    tl = cuda_time(lambda: moe_loop(x, w, e, moe.experts.gate_and_up_proj, moe.experts.down_proj))
    return {"moe_grouped_vs_loop_rel_err": rel, "moe_grouped_4096tok_ms": tg, "moe_loop_4096tok_ms": tl}


def check_tiny_reuse(dtype: str) -> dict:
    """Tiny model on the GPU: reuse vs recompute, T2I and IT2I, CFG on, greedy AR."""
    import numpy as np
    from PIL import Image

    from components.engine import ARRequest, DiTRequest, Engine, SamplingParams

    eng = Engine.load("tiny", device="cuda", dtype=dtype)
    cond = Image.fromarray((np.random.RandomState(0).rand(192, 256, 3) * 255).astype("uint8"))
    out = {}
    for name, images in (("t2i", []), ("it2i", [cond])):
        ar = eng.generate_ar([ARRequest(name, "make the sky purple", images)], SamplingParams(max_new_tokens=16))[0]
        # seed None: the AR row's seed, so IT2I's conditioning latents match and the KV is reused
        reuse = eng.dit(DiTRequest(ar, images, ar.prompt_kv, steps=8))
        again = eng.dit(DiTRequest(ar, images, ar.prompt_kv, steps=8))
        recompute = eng.dit(DiTRequest(ar, images, None, steps=8))
        a = np.asarray(reuse.image).astype(np.float64)
        b = np.asarray(recompute.image).astype(np.float64)
        mse = ((a - b) ** 2).mean()
        out[f"{dtype}_{name}"] = {
            "kv_path": reuse.kv_path,
            "latent_max_abs_diff": (reuse.latents - recompute.latents).abs().max().item(),
            "psnr_db": float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse),
            "rerun_bitwise_equal": bool(np.array_equal(np.asarray(reuse.image), np.asarray(again.image))),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    t0 = time.time()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers}
    info["tiny"] = {**check_tiny_reuse("float32"), **check_tiny_reuse("bfloat16")}
    print(json.dumps(info["tiny"]), flush=True)
    model = build_stack(args.layers)
    info["moe"] = check_moe(model)
    print(json.dumps(info["moe"]), flush=True)
    info["per_layer"] = time_stack(model, [int(b) for b in args.batches.split(",")])
    info["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    info["wall_s"] = time.time() - t0
    print(json.dumps(info, indent=1))
    per = info["per_layer"]
    print("\nper layer (ms):", " ".join(f"{k}={v:.2f}" for k, v in per.items()))
    for b in args.batches.split(","):
        ms = per[f"ar_decode_b{b}_ms"] * 32
        print(f"AR decode batch {b}: {ms:.1f} ms/token-step for 32 layers = {int(b) * 1000 / ms:.0f} tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
