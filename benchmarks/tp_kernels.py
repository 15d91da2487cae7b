"""Issue 18 item 1: the fast kernels at tensor-parallel sizes, on the GPU.

    python3 benchmarks/tp_kernels.py flex --heads 16,4 --out $OUT/flex_tp2.json
    python3 benchmarks/tp_kernels.py shapes --heads 16,4 --out $OUT/shapes_tp2.json
    python3 benchmarks/tp_kernels.py stack --tp 2 --layers 2 --out $OUT/stack_tp2.json

`flex`: flex attention as the engine compiles it (`kernels.attention.flex_attend`) at the per-rank
head counts of a TP size (TP1: 32 query / 8 KV heads, TP2: 16 / 4), over prefill masks of several
lengths (a second length is what makes dynamo recompile the kernel dynamic in the length). Each
variant reports per call whether it compiled and ran, the error text if not, and the time against
SDPA with the dense mask.

`shapes`: `transformer.attend` under `attention=flex` (through the fallback guard) at the engine's
prefill shapes: AR prefills, the DiT's recompute prefix (CFG batch 2) and its reuse tail (a few to
a few hundred queries over the cached prefix), flex vs SDPA with the dense mask, and the fallbacks
with the first error; optionally with the GPU memory filled up to a few GiB first (`--squeeze`).

`stack`: a full-width, reduced-depth stack (dummy weights, FP8 as `--quantization fp8` loads it)
on `--tp` ranks (components.runtime.ranks, NCCL): DiT steps over a cached prefix at several image buckets
(plain, compiled per bucket, compiled dynamic in the token count: the first call, compile included,
and the median warm step), an AR prefill, and AR decode (plain; CUDA graphs at TP1). Times are
CUDA-event medians of the whole stack on rank 0.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from benchmarks.engine_layers import cuda_time
from components.engine.kernels import attention as flex_kernels
from components.engine.transformer import SlotMask


def prefill_mask(total: int, batch: int = 1) -> SlotMask:
    """An IT2I AR prefill of `total` tokens: causal text with one conditioning image block."""
    blocks = torch.full((total,), -1, dtype=torch.long)
    blocks[60:min(total - 100, 60 + 4096 + 729)] = 0
    slots = torch.arange(total)
    return SlotMask(slots.expand(batch, -1), slots.expand(batch, -1), blocks.expand(batch, -1),
                    blocks.expand(batch, -1)).to("cuda")


@torch.no_grad()
def flex_variant(heads: int, kv_heads: int, lengths: list[int], dynamic: str, batch: int = 1) -> list[dict]:
    """flex_attend at each length in turn, compiled as the variant says."""
    torch._dynamo.reset()
    flex_kernels._compiled = None
    if dynamic != "engine":
        flex_kernels.allow_recompiles()
        flex_kernels._compiled = torch.compile(flex_kernels.flex_attention,
                                               dynamic={"none": None, "true": True, "false": False}[dynamic])
    out = []
    for n in lengths:
        q = torch.randn(batch, heads, n, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = prefill_mask(n, batch)
        row: dict = {"length": n}
        t0 = time.time()
        try:
            got = flex_kernels.flex_attend(q, k, v, mask.block_mask())
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 2)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)
            row["rel"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            row["flex_ms"] = cuda_time(lambda: flex_kernels.flex_attend(q, k, v, mask.block_mask()))
            row["sdpa_ms"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask.dense(), enable_gqa=True))
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            row["first_call_s"] = round(time.time() - t0, 2)
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            row["trace_tail"] = traceback.format_exc()[-1500:]
        out.append(row)
        print(json.dumps({"heads": [heads, kv_heads], "dynamic": dynamic, **{k: v for k, v in row.items()
                                                                               if k != "trace_tail"}})[:800],
              flush=True)
    return out


def _squeeze(leave_gib: float) -> torch.Tensor | None:
    """Hold all but `leave_gib` GiB of free GPU memory (as a full-size model on an 80 GB card does)."""
    free, _ = torch.cuda.mem_get_info()
    spare = int(free - leave_gib * 2**30)
    return torch.empty(spare, dtype=torch.uint8, device="cuda") if spare > 0 else None


@torch.no_grad()
def attend_shapes(heads: int, kv_heads: int, squeeze_gib: float = 0.0) -> dict:
    """attend() under attention=flex at the engine's prefill shapes (see the module docstring)."""
    from components.engine import kernels
    from components.engine.transformer import attend

    kernels.reset_fallbacks()
    torch._dynamo.reset()
    flex_kernels._compiled = None
    filler = _squeeze(squeeze_gib) if squeeze_gib else None
    shapes = [  # (name, batch, queries, keys, image block in the queries)
        ("ar_prefill_3k", 1, 3100, 3100, True), ("ar_prefill_6k", 1, 6050, 6050, True),
        ("ar_prefill_9k", 1, 9000, 9000, True), ("dit_prefix_cfg_6.8k", 2, 6796, 6796, True),
        ("reuse_tail_7", 1, 7, 3000, False), ("reuse_tail_40", 1, 40, 6800, False),
        ("reuse_tail_300", 1, 300, 6800, True), ("reuse_tail_uncond_1k", 1, 1100, 6800, True),
    ]
    out: dict = {"squeeze_gib": squeeze_gib}
    previous = kernels.configure(attention="flex")
    try:
        for name, b, t, s, image in shapes:
            q = torch.randn(b, heads, t, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, kv_heads, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            blocks = torch.full((s,), -1, dtype=torch.long)
            if image:
                blocks[s - t + 10:s - 10] = 0
            slots = torch.arange(s)
            mask = SlotMask(slots[s - t:].expand(b, -1), slots.expand(b, -1), blocks[s - t:].expand(b, -1),
                            blocks.expand(b, -1)).to("cuda")
            row: dict = {"batch": b, "queries": t, "keys": s}
            before = kernels.fallbacks()
            t0 = time.time()
            try:
                got = attend(q, k, v, mask)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(),
                                                                       enable_gqa=True)
                row["rel"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row["flex_ms"] = cuda_time(lambda: attend(q, k, v, mask))
                row["sdpa_ms"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask.dense(), enable_gqa=True))
            except Exception as e:  # noqa: BLE001 - a failure the guard did not catch is the finding
                row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
            row["fell_back"] = kernels.fallbacks() - before
            out[name] = row
            print(json.dumps({"heads": [heads, kv_heads], "shape": name, **row})[:600], flush=True)
    finally:
        kernels.configure(previous)
        del filler
    out["fallbacks"], out["first_error"] = kernels.fallbacks(), kernels.first_error()
    return out


# -- the reduced-depth stack on tensor-parallel ranks ---------------------------------------------
BUCKETS = ((64, 64), (52, 76), (40, 96))  # latent h x w: 1024x1024, 832x1216, 640x1536
PREFIX = 3000


def build_stack(layers: int, device, parallel=None, quantization: str = "fp8"):
    from components.engine.config import get_config
    from components.engine.engine import materialize
    from components.engine.parallel import parallelize
    from components.engine.transformer import HunyuanImage3ForCausalMM, TopKGate

    cfg = get_config("hunyuan-image-3").replace(num_hidden_layers=layers)
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(cfg, with_conditioning=False).to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, TopKGate):
            m.float()
    if parallel is not None:
        parallelize(model, parallel)
    materialize(model, device, None, seed=0, quantize=quantization == "fp8")
    return model.eval()


@torch.no_grad()
def dit_buckets(model, modes: list[str], batch: int = 2) -> dict:
    """Per mode and bucket: the first step (compile included) and the warm median, whole stack."""
    from components.engine import kernels
    from components.engine.kernels import compiled_layers
    from components.engine.transformer import HeadMask, attention_mask

    dev, hidden = model.device, model.config.hidden_size
    res: dict = {}
    outs: dict = {}
    for mode in modes:
        compiled_layers.DYNAMIC_TOKENS = mode == "dynamic"
        compiled_layers.reset()
        kernels.configure("plain" if mode == "plain" else "attention=auto,moe=auto,compile=on")
        before = kernels.fallbacks()
        r: dict = {}
        for h, w in BUCKETS:
            n = 1 + h * w
            total = PREFIX + n
            g = torch.Generator(device=dev).manual_seed(h * w)
            x_prefix = torch.randn(batch, PREFIX, hidden, device=dev, dtype=torch.bfloat16, generator=g)
            x_step = torch.randn(batch, n, hidden, device=dev, dtype=torch.bfloat16, generator=g)
            pos = torch.arange(total, dtype=torch.float64, device=dev).view(1, -1, 1).expand(batch, -1, 2)
            cache = model.new_cache(batch, total)
            slots = torch.arange(PREFIX)
            blocks = torch.full((PREFIX,), -1, dtype=torch.long)
            blocks[60:60 + 1000] = 0
            prefix_mask = SlotMask(slots.expand(batch, -1), slots.expand(batch, -1), blocks.expand(batch, -1),
                                   blocks.expand(batch, -1)).to(dev)
            all_blocks = torch.cat([blocks, torch.full((n,), -1, dtype=torch.long)])
            head = attention_mask(torch.tensor([[PREFIX]] * batch), torch.arange(total).expand(batch, -1),
                                  torch.tensor([[-1]] * batch), all_blocks.expand(batch, -1)).to(dev)
            step_mask = HeadMask(head, rows=1)
            with model.autocast():
                model.forward_layers(x_prefix, pos[:, :PREFIX], prefix_mask, cache)
                cache.commit()

                def step():
                    return model.forward_layers(x_step, pos[:, PREFIX:], step_mask, cache,
                                                compiled=mode != "plain")

                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                ms = cuda_time(step, warmup=1, repeat=5)
                outs[(mode, h, w)] = step()[:, -64:].float().cpu()
            r[f"{h}x{w}"] = {"first_s": round(first, 2), "step_ms": round(ms, 2)}
            if mode != "plain" and ("plain", h, w) in outs:
                a, b = outs[(mode, h, w)], outs[("plain", h, w)]
                r[f"{h}x{w}"]["rel_vs_plain"] = ((a - b).norm() / b.norm()).item()
            del cache
        r["fallbacks"] = kernels.fallbacks() - before
        res[mode] = r
        print(mode, json.dumps(r), flush=True)
    compiled_layers.DYNAMIC_TOKENS = False
    return res


@torch.no_grad()
def ar_paths(model, decode_batch: int = 8, kv: int = 3000) -> dict:
    """AR prefill (one row with an image block) and decode steps, plain vs the default kernels."""
    from components.engine import kernels
    from components.engine.kernels.decode import StaticDecoder, decode_mode

    dev, hidden, n = model.device, model.config.hidden_size, model.config.num_hidden_layers
    res: dict = {}
    for t in (3100, 9000):
        x = torch.randn(1, t, hidden, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(t, dtype=torch.float64, device=dev).view(1, -1, 1).expand(1, -1, 2)
        blocks = torch.full((t,), -1, dtype=torch.long)
        blocks[60:60 + 4096 + 729] = 0
        slots = torch.arange(t)
        mask = SlotMask(slots.view(1, -1), slots.view(1, -1), blocks.view(1, -1), blocks.view(1, -1)).to(dev)
        cache = model.new_cache(1, t)
        for mode in ("plain", "auto"):
            kernels.configure("plain" if mode == "plain" else "attention=auto,moe=auto")

            def prefill():
                cache.length = 0
                model.forward_layers(x, pos, mask, cache)
            with model.autocast():
                res[f"prefill_{t}_{mode}_ms"] = round(cuda_time(prefill, warmup=1, repeat=3), 2)
        del cache
    b = decode_batch
    cache = model.new_cache(b, kv + 64, rows=b)
    for tensor in cache.k_rows + cache.v_rows:
        tensor[:, :, :kv].normal_()
    ids = torch.randint(0, model.config.vocab_size, (b,), device=dev)
    x = model.embed_ids(ids.view(b, 1))
    pos = torch.full((b, 1, 2), float(kv), dtype=torch.float64, device=dev)
    kernels.configure("plain")
    with model.autocast():
        def plain():
            cache.length = kv
            return model.forward_layers(x, pos, torch.ones(b, 1, 1, kv + 1, dtype=torch.bool, device=dev), cache)
        res[f"decode_b{b}_plain_ms"] = round(cuda_time(plain, warmup=3, repeat=10), 3)
        kernels.configure("attention=auto,moe=auto,decode_graphs=auto")
        res["decode_mode"] = decode_mode(model)
        valid = torch.zeros(b, cache.capacity, dtype=torch.bool)
        valid[:, :kv] = True
        cache.length = kv
        dec = StaticDecoder(model, cache, valid, [0] * b, 0, graphs=res["decode_mode"] == "graphs")
        dec.set_inputs(ids.tolist())
        span = dec.span(kv)
        if res["decode_mode"] == "graphs":
            graph, _ = StaticDecoder.capture(lambda: dec.layers(span))
            res[f"decode_b{b}_graph_ms"] = round(cuda_time(graph.replay, warmup=3, repeat=20), 3)
        res[f"decode_b{b}_static_eager_ms"] = round(cuda_time(lambda: dec.layers(span), warmup=3, repeat=10), 3)
    res["layers"] = n
    return res


def rank_stack(layers: int, out: str, device: str = "cuda", parallel=None) -> dict:
    """One rank of `stack` (RankPool target; parallel=None at TP1)."""
    from components.engine import kernels

    dev = parallel.device if parallel is not None else torch.device("cuda", 0)
    tp = parallel.world_size if parallel is not None else 1
    info: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tp": tp, "layers": layers,
                  "date": time.strftime("%Y-%m-%d"), "quantization": "fp8", "errors": {}}
    t0 = time.time()
    model = build_stack(layers, dev, parallel)
    info["build_s"] = round(time.time() - t0, 1)
    for name, fn in (("dit", lambda: dit_buckets(model, ["plain", "static", "dynamic"])),
                     ("ar", lambda: ar_paths(model))):
        try:
            info[name] = fn()
        except Exception:  # noqa: BLE001 - report and go on
            info["errors"][name] = traceback.format_exc()[-3000:]
            print(info["errors"][name], flush=True)
    info["fallbacks"], info["first_error"] = kernels.fallbacks(), kernels.first_error()
    info["peak_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    if parallel is None or parallel.rank == 0:
        with open(out, "w") as f:
            json.dump(info, f, indent=1)
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=["flex", "shapes", "stack"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--squeeze", type=float, default=0.0, help="shapes: with only this many GiB free")
    parser.add_argument("--heads", default="16,4", help="query,KV heads per rank (TP2: 16,4; TP1: 32,8)")
    parser.add_argument("--lengths", default="3100,4700,6050")
    parser.add_argument("--variants", default="engine,false", help="engine (as shipped), none, true, false")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    heads, kv_heads = map(int, args.heads.split(","))
    if args.section == "stack":
        if args.tp == 1:
            rank_stack(args.layers, args.out)
        else:
            from components.runtime.ranks import RankPool

            with RankPool(args.tp, "cuda") as pool:
                pool.run(rank_stack, {"layers": args.layers, "out": args.out})
        return
    if args.section == "shapes":
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": [heads, kv_heads],
                "date": time.strftime("%Y-%m-%d"), **attend_shapes(heads, kv_heads, args.squeeze)}
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    info: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d"), "heads": [heads, kv_heads], "lengths": lengths}
    for variant in args.variants.split(","):
        info[variant] = flex_variant(heads, kv_heads, lengths, variant)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
