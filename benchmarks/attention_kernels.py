"""Flex attention with block masks and compiled DiT steps against the plain paths, at full size.

Full-dimension HunyuanImage-3 shapes (hidden 4096, 32 Q / 8 KV heads of 128, 64 experts top-8 of
width 3072), dummy weights, bf16 on one GPU; per-layer times from a short layer stack (stack time /
layers). Sections, each written to the JSON as soon as it is done:

1. masked attention alone, 2 x 10 750 tokens (the DiT first step's mask: causal prefix, one
   conditioning-image block, the generated image block): SDPA with the dense bool mask, flex with
   the block mask (default kernel options and a few Triton tile choices), causal SDPA for
   reference; block-mask build time; relative error flex vs SDPA;
2. DiT first step per layer, plain (SDPA bool mask) vs flex: one forward over the whole
   2 x 10 750 sequence, and the prefix prefill (2 x 6 796, what the recompute path runs);
3. DiT cached step per layer (2 x 3 954 image tokens over a 6 796-token prefix), plain vs
   compiled layers; compile time; a second "request" of the same bucket with another prefix length
   must not recompile (dynamo frame counter).

    python benchmarks/attention_kernels.py --layers 2 --out $OUT/attention_kernels.json
    python benchmarks/attention_kernels.py --small   # CPU smoke test of the script (tiny model)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from components.engine import kernels
from components.engine.config import get_config
from components.engine.kernels import attention as flex_kernels
from components.engine.transformer import HeadMask, HunyuanImage3ForCausalMM, SlotMask, attend, attention_mask
from components.engine.weights import init_dummy_weights

PREFIX, IMAGE = 6796, 3953  # anchors (1216x832 IT2I): the cached step has 1 + IMAGE tokens
COND_BLOCK = (60, 60 + 3952 + 1 + 729)  # one conditioning image: VAE 76x52 + sep + ViT slots
TILES = [  # Triton options tried for the flex kernel (BLOCK_M / BLOCK_N divide the 128 mask tile)
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
]


def timer(device: str):
    """Median milliseconds of fn(): CUDA events on the GPU (engine_layers.cuda_time), else the host clock."""
    if device == "cuda":
        from benchmarks.engine_layers import cuda_time

        return cuda_time

    def run(fn, warmup: int = 2, repeat: int = 5) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def sequence_mask(total: int, gen_start: int | None, cond: tuple[int, int], batch: int = 2) -> SlotMask:
    blocks = torch.full((total,), -1, dtype=torch.long)
    blocks[cond[0]:cond[1]] = 0
    if gen_start is not None:
        blocks[gen_start:] = 1
    slots = torch.arange(total).expand(batch, -1)
    return SlotMask(slots, slots, blocks.expand(batch, -1), blocks.expand(batch, -1))


def build_stack(config: str, layers: int, device: str, dtype: torch.dtype) -> HunyuanImage3ForCausalMM:
    cfg = get_config(config).replace(num_hidden_layers=layers)
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(cfg, with_conditioning=False)
    model = model.to_empty(device=device)
    init_dummy_weights(model, seed=0)
    model = model.to(dtype).eval()
    for m in model.modules():
        if hasattr(m, "wg"):
            m.float()  # the router stays fp32, as in the checkpoint
    return model


class Bench:
    def __init__(self, args) -> None:
        self.args, self.device = args, "cuda" if torch.cuda.is_available() and not args.small else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.time = timer(self.device)
        small = args.small
        self.prefix, self.image = (380, 200) if small else (PREFIX, IMAGE)
        self.cond = (20, 150) if small else COND_BLOCK
        self.total = self.prefix + 1 + self.image
        self.info: dict = {"device": torch.cuda.get_device_name() if self.device == "cuda" else "cpu",
                           "torch": torch.__version__, "layers": args.layers, "tokens": self.total,
                           "sections": {}}

    def save(self) -> None:
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.info, f, indent=1)

    def section(self, name: str, fn) -> None:
        t0 = time.time()
        try:
            res = fn()
        except Exception:  # noqa: BLE001 - record and go on with the next section
            res = {"error": traceback.format_exc()[-3000:]}
        res["section_s"] = round(time.time() - t0, 1)
        self.info["sections"][name] = res
        print(name, json.dumps(res), flush=True)
        self.save()

    # 1 ------------------------------------------------------------------------------------------
    def attention(self) -> dict:
        hq, hkv, d = (4, 2, 16) if self.args.small else (32, 8, 128)
        b, t = 2, self.total
        g = torch.Generator(self.device).manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, device=self.device, dtype=self.dtype, generator=g)
                   for h in (hq, hkv, hkv))
        mask = sequence_mask(t, self.prefix + 1, self.cond).to(self.device)
        res: dict = {"shape": [b, hq, hkv, t, d]}
        dense = mask.dense()
        res["visible_pairs_frac"] = dense.float().mean().item()
        res["sdpa_bool_ms"] = self.time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True))
        res["sdpa_causal_ms"] = self.time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        # block mask build, warm (a fresh SlotMask each time, as every forward makes one): ours from
        # the broadcast dense mask vs flex attention's create_block_mask (vmap over the mask_mod)
        from torch.nn.attention.flex_attention import create_block_mask

        bm = mask.block_mask()
        res["block_mask_build_ms"] = self.time(
            lambda: sequence_mask(t, self.prefix + 1, self.cond).to(self.device).block_mask(), 1, 3)
        res["create_block_mask_ms"] = self.time(lambda: create_block_mask(bm.mask_mod, b, None, t, t, device=self.device), 1, 3)
        ref_bm = create_block_mask(bm.mask_mod, b, None, t, t, device=self.device)
        res["block_mask_same_tiles_as_create_block_mask"] = bool(torch.equal(bm.to_dense(), ref_bm.to_dense()))
        res["block_mask_sparsity_pct"] = float(bm.sparsity())
        del ref_bm
        # layouts: the layer hands flex transposed views of [B, T, H, D]; CONTIGUOUS copies them first
        qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        for contiguous in (True, False) if self.args.sweep else (True,):
            flex_kernels.CONTIGUOUS = contiguous
            name = "copied" if contiguous else "strided"
            out = flex_kernels.flex_attend(q, k, v, bm)  # compile for contiguous inputs first
            t0 = time.perf_counter()
            out = flex_kernels.flex_attend(qs, ks, vs, bm)
            sync(self.device)
            res[f"flex_layer_layout_{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
            res[f"flex_layer_layout_{name}_rel"] = rel(out, ref)
            res[f"flex_layer_layout_{name}_ms"] = self.time(lambda: flex_kernels.flex_attend(qs, ks, vs, bm))
        flex_kernels.CONTIGUOUS = True
        del qs, ks, vs
        best = None
        for options in [None] + (TILES if self.args.sweep and self.device == "cuda" else []):
            name = "default" if options is None else "m{BLOCK_M}_n{BLOCK_N}_w{num_warps}_s{num_stages}".format(**options)
            flex_kernels.KERNEL_OPTIONS = options
            try:
                t0 = time.perf_counter()
                out = flex_kernels.flex_attend(q, k, v, bm)
                sync(self.device)
                res[f"flex_{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
                res[f"flex_{name}_rel_vs_sdpa_bool"] = rel(out, ref)
                res[f"flex_{name}_ms"] = ms = self.time(lambda: flex_kernels.flex_attend(q, k, v, bm))
                if best is None or ms < best[1]:
                    best = (options, ms, name)
            except Exception as e:  # noqa: BLE001 - a tile choice the kernel rejects
                res[f"flex_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        flex_kernels.KERNEL_OPTIONS = best[0]
        if self.device == "cuda":  # a second length: the shared compiled kernel turns dynamic in the lengths
            res.update(self.prefix_attention(q, k, v))
        res["flex_best"], res["flex_best_ms"] = best[2], best[1]
        # the engine's own entry point (SlotMask -> attend under attention=flex), the best tiles
        kernels.configure(attention="flex")
        res["attend_flex_rel_vs_sdpa_bool"] = rel(attend(q, k, v, mask), ref)
        kernels.configure(attention="sdpa")
        # negative control: the image blocks dropped from the mask (causal only) is far off
        res["control_causal_rel_vs_sdpa_bool"] = rel(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                    enable_gqa=True), ref)
        flops = 4 * hq * d * dense.sum().item()  # QK^T and PV over the visible pairs of both rows
        res["flex_best_tflops"] = flops / (best[1] * 1e-3) / 1e12
        return res

    def prefix_attention(self, q, k, v) -> dict:
        """The DiT prefix prefill's attention alone (2 x PREFIX, conditioning-image block): SDPA bool,
        the engine's flex (compiled once for all lengths: dynamic after the second), and flex
        compiled for this length only (static)."""
        from torch.nn.attention.flex_attention import flex_attention

        t = self.prefix
        q, k, v = (x[:, :, :t].contiguous() for x in (q, k, v))
        mask = sequence_mask(t, None, self.cond).to(self.device)
        dense, bm = mask.dense(), mask.block_mask()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        res = {"prefix_sdpa_bool_ms": self.time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                                                      enable_gqa=True)),
               "prefix_visible_pairs_frac": dense.float().mean().item()}
        res["prefix_flex_rel"] = rel(flex_kernels.flex_attend(q, k, v, bm), ref)
        res["prefix_flex_dynamic_ms"] = self.time(lambda: flex_kernels.flex_attend(q, k, v, bm))
        static = torch.compile(flex_attention, dynamic=False)
        static(q, k, v, block_mask=bm, enable_gqa=True)
        res["prefix_flex_static_ms"] = self.time(lambda: static(q, k, v, block_mask=bm, enable_gqa=True))
        return res

    # 2 ------------------------------------------------------------------------------------------
    def first_step(self, model) -> dict:
        n, dev, hidden = model.config.num_hidden_layers, self.device, model.config.hidden_size
        g = torch.Generator(dev).manual_seed(1)
        res: dict = {}
        pos = torch.arange(self.total, dtype=torch.float64, device=dev).view(1, -1, 1).expand(2, -1, 2)
        x = torch.randn(2, self.total, hidden, device=dev, dtype=self.dtype, generator=g)
        xp = torch.randn(2, self.prefix, hidden, device=dev, dtype=self.dtype, generator=g)
        cache = model.new_cache(2, self.total)

        def prefill(mask):
            cache.length = 0
            out = model.forward_layers(xp, pos[:, :self.prefix], mask, cache)
            cache.commit()
            return out

        outs = {}
        # one SlotMask per forward, as the engine builds it; made before the timing (its dense / block
        # mask is built once per forward and serves all 32 layers: section 1 times the build)
        for value in ("sdpa", "flex", "flex_compiled") + (("flex_strided",) if self.args.sweep else ()):
            kernels.configure(attention=value.split("_")[0])
            flex_kernels.CONTIGUOUS = value != "flex_strided"
            compiled = value == "flex_compiled"
            mask = sequence_mask(self.total, self.prefix + 1, self.cond).to(dev)
            t0 = time.perf_counter()
            outs[value] = model.forward_layers(x, pos, mask, None, compiled=compiled)
            sync(dev)
            res[f"one_forward_{value}_first_call_s"] = round(time.perf_counter() - t0, 1)
            res[f"one_forward_{value}_ms"] = self.time(
                lambda: model.forward_layers(x, pos, mask, None, compiled=compiled)) / n
            if value in ("sdpa", "flex"):
                pmask = sequence_mask(self.prefix, None, self.cond).to(dev)
                outs[f"prefill_{value}"] = prefill(pmask)
                res[f"prefix_prefill_{value}_ms"] = self.time(lambda: prefill(pmask)) / n
                del pmask
            del mask
        flex_kernels.CONTIGUOUS = True
        for value in outs:
            if value.startswith("flex"):
                res[f"one_forward_{value}_rel"] = rel(outs[value], outs["sdpa"])
        res["prefix_prefill_rel"] = rel(outs["prefill_flex"], outs["prefill_sdpa"])
        kernels.configure(attention="sdpa")
        return res

    # 3 ------------------------------------------------------------------------------------------
    def cached_step(self, model) -> dict:
        from components.engine.kernels import compiled_layers

        n, dev, hidden = model.config.num_hidden_layers, self.device, model.config.hidden_size
        if self.device == "cpu":
            compiled_layers.BACKEND = "aot_eager"
        g = torch.Generator(dev).manual_seed(2)
        res: dict = {}
        cache = model.new_cache(2, self.total)
        for layer in range(n):  # a random prefix (never time on zeros)
            cache.k[layer].normal_(generator=g)
            cache.v[layer].normal_(generator=g)
        blocks = torch.full((self.total,), -1, dtype=torch.long)
        blocks[self.cond[0]:self.cond[1]] = 0
        blocks[self.prefix + 1:] = 1

        def step_inputs(prefix: int):
            end = prefix + 1 + self.image
            bl = torch.cat([blocks[:prefix], blocks[self.prefix:]])
            head = attention_mask(torch.tensor([[prefix]] * 2), torch.arange(end).expand(2, -1),
                                  bl[prefix:prefix + 1].expand(2, -1), bl.expand(2, -1))
            pos = torch.arange(prefix, end, dtype=torch.float64, device=dev).view(1, -1, 1).expand(2, -1, 2)
            return pos, HeadMask(head.to(dev), rows=1)

        x = torch.randn(1, 1 + self.image, hidden, device=dev, dtype=self.dtype, generator=g).expand(2, -1, -1)
        pos, hmask = step_inputs(self.prefix)
        cache.length = self.prefix

        def step(compiled: bool):
            return model.forward_layers(x, pos, hmask, cache, compiled=compiled)

        plain = step(False)
        res["plain_ms"] = self.time(lambda: step(False)) / n
        f0 = frames()
        t0 = time.perf_counter()
        fast = step(True)
        sync(dev)
        res["compile_s"] = round(time.perf_counter() - t0, 1)
        res["compiled_frames"] = frames() - f0
        res["compiled_rel_vs_plain"] = rel(fast, plain)
        f1 = frames()
        res["compiled_ms"] = self.time(lambda: step(True)) / n
        res["recompiles_over_steps"] = frames() - f1
        # a second request of the same bucket: another prefix length, same step shape
        other = self.prefix - 97
        pos, hmask = step_inputs(other)
        cache.length = other
        f2 = frames()
        step(True)
        res["recompiles_second_request"] = frames() - f2
        from torch._dynamo.utils import counters

        res["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
        return res

    # 4 ------------------------------------------------------------------------------------------
    def tiny(self) -> dict:
        """Tiny model end to end on the GPU in bf16, plain kernels vs `auto` (flex attention for
        masked prefills, compiled DiT steps): reuse vs recompute PSNR, rerun determinism, auto vs
        plain PSNR; T2I and IT2I, CFG on, greedy AR."""
        import numpy as np
        from PIL import Image

        from components.engine import ARRequest, DiTRequest, Engine, SamplingParams

        def psnr(a, b) -> float:
            mse = ((np.asarray(a).astype(np.float64) - np.asarray(b).astype(np.float64)) ** 2).mean()
            return float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))

        eng = Engine.load("tiny", device=self.device, dtype="bfloat16" if self.device == "cuda" else "float32")
        cond = Image.fromarray((np.random.RandomState(0).rand(192, 256, 3) * 255).astype("uint8"))
        res, images = {}, {}
        for spec in ("plain", "auto", "auto_flex_causal"):
            kernels.configure("attention=sdpa,compile=off" if spec == "plain" else "attention=auto,compile=auto")
            flex_kernels.CAUSAL_SDPA = spec != "auto_flex_causal"  # causal-only masks to flex too
            for name, imgs in (("t2i", []), ("it2i", [cond])):
                t0 = time.perf_counter()
                ar = eng.generate_ar([ARRequest(name, "make the sky purple", imgs)], SamplingParams(max_new_tokens=16))[0]
                reuse = eng.dit(DiTRequest(ar, imgs, ar.prompt_kv, steps=8, seed=1))
                again = eng.dit(DiTRequest(ar, imgs, ar.prompt_kv, steps=8, seed=1))
                recompute = eng.dit(DiTRequest(ar, imgs, None, steps=8, seed=1))
                images[(spec, name)] = reuse.image
                res[f"{spec}_{name}"] = {"reuse_vs_recompute_psnr_db": psnr(reuse.image, recompute.image),
                                         "rerun_bitwise": bool(np.array_equal(np.asarray(reuse.image),
                                                                              np.asarray(again.image))),
                                         "tokens": ar.generated_ids, "s": round(time.perf_counter() - t0, 1)}
        kernels.configure("attention=auto,compile=auto")
        flex_kernels.CAUSAL_SDPA = True
        for name in ("t2i", "it2i"):
            res[f"auto_vs_plain_{name}_psnr_db"] = psnr(images[("auto", name)], images[("plain", name)])
            res[f"auto_vs_plain_{name}_same_tokens"] = (res[f"auto_{name}"]["tokens"]
                                                        == res[f"plain_{name}"]["tokens"])
        for key in res:
            if isinstance(res[key], dict):
                res[key].pop("tokens", None)
        return res

    def run(self) -> None:
        self.section("attention", self.attention)
        model = build_stack("tiny" if self.args.small else "hunyuan-image-3", self.args.layers, self.device, self.dtype)
        self.info["moe_impl"] = "grouped" if self.device == "cuda" else "loop"
        self.section("first_step", lambda: self.first_step(model))
        self.section("cached_step", lambda: self.cached_step(model))
        if self.device == "cuda":
            self.info["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del model
            torch.cuda.empty_cache()
            self.section("tiny", self.tiny)
        self.save()
        self.table()

    def table(self) -> None:
        s = self.info["sections"]
        a, f, c = s.get("attention", {}), s.get("first_step", {}), s.get("cached_step", {})

        def g(d, key, fmt="{:.2f}"):
            return fmt.format(d[key]) if key in d else "n/a"

        print(f"\n{self.info['device']}  torch {self.info['torch']}  {self.args.layers}-layer stack, ms")
        print(f"masked attention 2x{self.total}: sdpa bool {g(a, 'sdpa_bool_ms')} | flex default "
              f"{g(a, 'flex_default_ms')} | flex best ({a.get('flex_best', 'n/a')}) {g(a, 'flex_best_ms')} | "
              f"causal sdpa {g(a, 'sdpa_causal_ms')} | rel {g(a, 'attend_flex_rel_vs_sdpa_bool', '{:.1e}')} "
              f"| block mask build {g(a, 'block_mask_build_ms')}  (goal <= 7)")
        print(f"flex, layer's layout: copied to contiguous {g(a, 'flex_layer_layout_copied_ms')} | strided "
              f"{g(a, 'flex_layer_layout_strided_ms')} | create_block_mask {g(a, 'create_block_mask_ms')}")
        print(f"DiT first step / layer, one forward: plain {g(f, 'one_forward_sdpa_ms')} -> flex "
              f"{g(f, 'one_forward_flex_ms')} (rel {g(f, 'one_forward_flex_rel', '{:.1e}')}) | flex strided "
              f"{g(f, 'one_forward_flex_strided_ms')} | flex + compiled layers {g(f, 'one_forward_flex_compiled_ms')}"
              f"  (goal <= 30)")
        print(f"prefix attention 2x{self.prefix}: sdpa bool {g(a, 'prefix_sdpa_bool_ms')} | flex (engine, dynamic) "
              f"{g(a, 'prefix_flex_dynamic_ms')} | flex static {g(a, 'prefix_flex_static_ms')}")
        print(f"DiT prefix prefill / layer: plain {g(f, 'prefix_prefill_sdpa_ms')} -> flex "
              f"{g(f, 'prefix_prefill_flex_ms')} (rel {g(f, 'prefix_prefill_rel', '{:.1e}')})")
        print(f"DiT cached step / layer: plain {g(c, 'plain_ms')} -> compiled {g(c, 'compiled_ms')} "
              f"(rel {g(c, 'compiled_rel_vs_plain', '{:.1e}')}, compile {g(c, 'compile_s', '{}')} s, recompiles: "
              f"steps {c.get('recompiles_over_steps', 'n/a')}, 2nd request {c.get('recompiles_second_request', 'n/a')})"
              f"  (goal <= 13)")
        t = s.get("tiny", {})
        if t and "error" not in t:
            for name in ("t2i", "it2i"):
                print(f"tiny bf16 {name}: reuse vs recompute PSNR plain {t[f'plain_{name}']['reuse_vs_recompute_psnr_db']:.1f}"
                      f" / auto {t[f'auto_{name}']['reuse_vs_recompute_psnr_db']:.1f} dB; auto vs plain "
                      f"{t[f'auto_vs_plain_{name}_psnr_db']:.1f} dB, same tokens {t[f'auto_vs_plain_{name}_same_tokens']}, "
                      f"rerun bitwise {t[f'auto_{name}']['rerun_bitwise']}; causal masks to flex too: reuse vs "
                      f"recompute {t[f'auto_flex_causal_{name}']['reuse_vs_recompute_psnr_db']:.1f} dB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU: checks the script")
    parser.add_argument("--sweep", action="store_true", help="also Triton tile choices and the strided layout")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_kernels.json"))
    args = parser.parse_args()
    with torch.no_grad():  # inference, as the engine runs
        Bench(args).run()


if __name__ == "__main__":
    main()
