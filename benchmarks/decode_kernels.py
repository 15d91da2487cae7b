"""AR decode: plain eager step vs the static-shape step (kernels/decode.py), eager and as CUDA
graph replays, on a full-dimension layer stack (dummy weights, bf16, under the AR's autocast) with
6 800 cached tokens; the equality of graph and eager; the HBM floor; and the tiny model's AR end
to end on the GPU through the AR scheduler (eager vs graphs: tokens and decode wall time).

    python benchmarks/decode_kernels.py --layers 4 --out decode.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.engine_layers import build_stack, cuda_time
from components.engine import kernels
from components.engine.kernels import decode
from components.engine.kernels.decode import GROUPED_FROM, SPAN_STEP, DecodeMask, StaticDecoder
from components.engine.transformer import MoE

# the static step's two attentions, forced: SDPA's own GQA, or each KV group's heads as queries
IMPLS = {"gqa": 10**9, "grouped": 0}

AR_KV = 6800
EXTRA = 8192 - AR_KV  # capacity beyond the filled length (the AR's CoT budget); 8192 = 8 span steps
DEVICE = "cuda"


def copy_bandwidth() -> float:
    """Achievable HBM bandwidth (bytes/s): a 2 GiB device copy reads and writes every byte."""
    a = torch.empty(2**30, dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), warmup=2, repeat=10)
    return 2 * a.numel() * 2 / (ms / 1e3)


def floor_bytes(model, batch: int, kv: int) -> float:
    """Bytes one decode step must read per layer: attention and router weights, the shared expert,
    the routed experts a batch touches (expected distinct experts under uniform routing), the K/V."""
    cfg = model.config
    layer = model.model.layers[0]
    attn = sum(p.numel() * p.element_size() for p in layer.self_attn.parameters())
    moe = layer.mlp
    router = moe.gate.wg.weight.numel() * moe.gate.wg.weight.element_size()
    shared = sum(p.numel() * p.element_size() for p in moe.shared_mlp.parameters())
    e, k = moe.num_experts, moe.top_k
    per_expert = sum(p.numel() * p.element_size() for p in moe.experts.parameters()) / e
    touched = e * (1 - (1 - k / e) ** batch)
    kv_bytes = 2 * batch * cfg.num_key_value_heads * cfg.attention_head_dim * kv * 2
    return attn + router + shared + touched * per_expert + kv_bytes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def stack_decode(model, batches: list[int]) -> dict:
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    res: dict = {}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    for b in batches:
        r: dict = {}
        torch.manual_seed(b)
        cache = model.new_cache(b, AR_KV + EXTRA, rows=b)  # b is a bucket itself
        for t in cache.k_rows + cache.v_rows:
            t[:, :, :AR_KV].normal_()
        cache.length = AR_KV
        ids = torch.randint(0, cfg.vocab_size, (b,), device=DEVICE)
        valid = torch.zeros(b, cache.capacity, dtype=torch.bool)
        valid[:, :AR_KV] = True
        dec = StaticDecoder(model, cache, valid, [0] * b, 0, graphs=True)
        dec.set_inputs(ids.tolist())
        span = dec.span(AR_KV)
        with model.autocast():
            # plain eager step (as the removed static-batch loop): the cache sliced to AR_KV + 1, a host-built mask
            x = model.embed_ids(ids.view(b, 1))
            pos = torch.full((b, 1, 2), float(AR_KV), dtype=torch.float64, device=DEVICE)

            def plain():
                cache.length = AR_KV
                mask = torch.ones(b, 1, 1, AR_KV + 1, dtype=torch.bool).to(DEVICE)
                return model.forward_layers(x, pos, mask, cache)

            r["plain_eager_ms"] = cuda_time(plain, warmup=3, repeat=10) / n_layers
            h_plain = plain()
            cache.length = AR_KV
            r["static_eager_ms"] = cuda_time(lambda: dec.layers(span), warmup=3, repeat=10) / n_layers
            h_eager = dec.layers(span).clone()
            graph, out = StaticDecoder.capture(lambda: dec.layers(span))
            graph.replay()
            torch.cuda.synchronize()
            r["graph_ms"] = cuda_time(graph.replay, warmup=3, repeat=20) / n_layers
            h_graph = out.clone()
            r["graph_equals_eager_bitwise"] = bool(torch.equal(h_graph, h_eager))
            r["graph_vs_eager_max_abs"] = (h_graph.float() - h_eager.float()).abs().max().item()
            r["static_vs_plain_rel"] = rel(h_eager, h_plain)
            # attending over the whole capacity instead of the span bucket, and the other attentions
            r["span"], r["capacity"] = span, cache.capacity
            for impl, threshold in IMPLS.items():
                decode.GROUPED_FROM = threshold
                for name, width in (("span", span), ("cap", cache.capacity)):
                    h_e = dec.layers(width).clone()
                    g_i, o_i = StaticDecoder.capture(lambda: dec.layers(width))
                    g_i.replay()
                    r[f"{impl}_{name}_graph_ms"] = cuda_time(g_i.replay, warmup=3, repeat=20) / n_layers
                    r[f"{impl}_{name}_graph_eq_eager"] = bool(torch.equal(o_i, h_e))
                    del g_i, o_i
            decode.GROUPED_FROM = GROUPED_FROM
            r["graph_full_capacity_ms"] = r[f"{'grouped' if b * 8 >= GROUPED_FROM else 'gqa'}_cap_graph_ms"]
            # where the time goes: the MoE block alone (one layer, graph)
            layer0 = model.model.layers[0]
            xm = torch.randn(b, 1, cfg.hidden_size, device=DEVICE, dtype=model.dtype)
            g_m, _ = StaticDecoder.capture(lambda: layer0.mlp(layer0.post_attention_layernorm(xm)))
            r["moe_graph_ms"] = cuda_time(g_m.replay, warmup=3, repeat=20)
            del g_m
            r.update(routing_flips(model, plain, lambda: dec.layers(span)))
            # the whole AR step: host inputs, graph (layers + lm_head), greedy choice, one host copy
            dec.run(span)

            def full_step():
                dec.set_inputs(ids.tolist())
                logits = dec.run(span)
                return logits.argmax(-1).tolist()

            for _ in range(3):
                full_step()
            t0 = time.perf_counter()
            for _ in range(20):
                full_step()
            r["graph_full_step_ms"] = (time.perf_counter() - t0) / 20 * 1e3
            r["floor_ms"] = floor_bytes(model, b, AR_KV) / bw * 1e3
            r["floor_nominal_3.35TBps_ms"] = floor_bytes(model, b, AR_KV) / 3.35e12 * 1e3
            r["graph_pct_of_floor"] = 100 * r["floor_ms"] / r["graph_ms"]
        del dec, cache, graph, out
        torch.cuda.empty_cache()
        res[f"b{b}"] = r
        print(f"b{b}", json.dumps(r), flush=True)
    return res


def routing_flips(model, plain, static) -> dict:
    """Static vs plain: layer 0's attention output (same inputs, so attention numerics alone) and,
    per layer, the share of tokens whose top-k expert set differs (MoE routing amplifies tiny
    differences into large ones, above all with dummy weights whose router is near uniform)."""
    routes: list = []
    attn_out: list = []
    real_route = MoE.route

    def record(self, x):
        w, e = real_route(self, x)
        routes.append(e.sort(dim=-1).values.clone())
        return w, e

    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, i, o: attn_out.append(o.clone()))
    MoE.route = record
    try:
        plain()
        n = len(routes)
        static()
    finally:
        MoE.route = real_route
        hook.remove()
    flips = [(a != b).any(-1).float().mean().item() for a, b in zip(routes[:n], routes[n:])]
    return {"layer0_attention_static_vs_plain_rel": rel(attn_out[1], attn_out[0]), "route_flip_share_per_layer": flips}


def attention_micro(batches: list[int], kv: int = AR_KV + 1, capacity: int = 8192) -> dict:
    """One layer's decode attention alone (graph replay), against an fp32 reference."""
    out = {}
    for b in batches:
        torch.manual_seed(0)
        q = torch.randn(b, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(b, 8, capacity, 128, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        keep = torch.zeros(b, 1, 1, capacity, dtype=torch.bool, device=DEVICE)
        keep[..., :kv] = True
        ref = F.scaled_dot_product_attention(q.float(), k[:, :, :kv].float(), v[:, :, :kv].float(), enable_gqa=True)
        r = {}
        mask_plain = torch.ones(b, 1, 1, kv, dtype=torch.bool, device=DEVICE)
        fns = {"plain_gqa_mask": lambda: F.scaled_dot_product_attention(q, k[:, :, :kv], v[:, :, :kv],
                                                                        attn_mask=mask_plain, enable_gqa=True)}
        for impl, threshold in IMPLS.items():
            fns[impl] = lambda threshold=threshold: _attend(threshold, q, k[:, :, :7168], v[:, :, :7168],
                                                            keep[..., :7168])
        for name, fn in fns.items():
            try:
                g, o = StaticDecoder.capture(fn)
                g.replay()
                r[f"{name}_us"] = cuda_time(g.replay, warmup=3, repeat=20) * 1e3
                r[f"{name}_rel_vs_fp32"] = rel(o, ref)
                del g, o
            except Exception as e:  # noqa: BLE001
                r[f"{name}_error"] = repr(e)[:300]
        out[f"b{b}"] = r
        print("attention", b, json.dumps(r), flush=True)
    decode.GROUPED_FROM = GROUPED_FROM
    return out


def _attend(threshold, q, k, v, keep):
    decode.GROUPED_FROM = threshold
    return DecodeMask(keep).attend(q, k, v)


@torch.no_grad()
def autocast_cache_hazard(model, b: int = 64) -> dict:
    """Why a graph can differ from its eager step: captured with autocast's cast cache on, the
    graph reads the cached bf16 copy of the fp32 router weight by address; once the autocast
    context exits that copy is freed and its memory reused, and replays route with garbage."""
    cfg = model.config
    cache = model.new_cache(b, AR_KV + 1, rows=b)
    for t in cache.k_rows + cache.v_rows:
        t[:, :, :AR_KV].normal_()
    cache.length = AR_KV
    valid = torch.zeros(b, cache.capacity, dtype=torch.bool)
    valid[:, :AR_KV] = True
    dec = StaticDecoder(model, cache, valid, [0] * b, 0, graphs=True)
    dec.set_inputs(torch.randint(0, cfg.vocab_size, (b,)).tolist())
    span = dec.span(AR_KV)
    out = {}
    for cached in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cached):
            expect = dec.layers(span).clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dec.layers(span)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = dec.layers(span)
            graph.replay()
            same_context = torch.equal(got, expect)
        # reuse the freed blocks (the bf16 copies of the [64, 4096] router weights)
        junk = [torch.randn(64, 4096, device=DEVICE, dtype=torch.bfloat16) for _ in range(64)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            graph.replay()
            out[f"cache_{'on' if cached else 'off'}"] = {
                "replay_in_capture_context_bitwise": bool(same_context),
                "replay_after_context_exit_bitwise": bool(torch.equal(got, expect)),
                "replay_after_context_exit_rel": rel(got, expect)}
        del junk, graph
    print("autocast cache hazard", json.dumps(out), flush=True)
    return out


def tiny_ar(dtype: str) -> dict:
    """Tiny model on the GPU through the AR scheduler: the static step eager (decode_graphs=off) vs
    replayed as CUDA graphs, greedy tokens and decode time for a 32-token answer at batch 1 and 4;
    seeded sampling reproducible under graphs."""
    from components.engine import ARRequest, Engine, SamplingParams

    eng = Engine.load("tiny", device=DEVICE, dtype=dtype)
    prompts = ["a cat", "a watercolor painting of a golden horse near a river at sunset",
               "a red car", "a blue boat on the sea at night, stars"]
    greedy = SamplingParams(temperature=0, max_new_tokens=32)
    sampled = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=32)
    out: dict = {}

    def run(mode, batch, sp):
        previous = kernels.configure(decode_graphs="on" if mode == "graphs" else "off")
        try:
            # bot_task auto: a text answer of 32 tokens unless the model writes <|endoftext|>
            reqs = [ARRequest(f"r{i}", prompts[i], [], bot_task="auto", seed=i) for i in range(batch)]
            eng.generate_ar(reqs, sp)  # warm-up (CUDA init, first-call allocations)
            torch.cuda.synchronize()
            times, res = [], None
            for _ in range(3):
                res = eng.generate_ar(reqs, sp)
                times.append(res[0].timings["ar_decode_s"])
            return res, min(times)
        finally:
            kernels.configure(previous)

    # fp32: the per-expert MoE loop syncs with the host, so the static step runs eagerly there
    fast = "graphs" if dtype == "bfloat16" else "eager"
    for batch in (1, 4):
        toks = {}
        for mode in ("eager", "graphs") if fast == "graphs" else ("eager",):
            res, sec = run(mode, batch, greedy)
            toks[mode] = [o.generated_ids for o in res]
            steps = res[0].timings["ar_decode_steps"]
            out[f"{dtype}_b{batch}_{mode}"] = {"decode_s": sec, "steps": steps,
                                               "ms_per_step": sec / max(steps, 1) * 1e3}
        out[f"{dtype}_b{batch}_greedy_tokens"] = {
            "graphs_eq_eager": toks["graphs"] == toks["eager"] if "graphs" in toks else None,
            "lens": [len(t) for t in toks["eager"]],
            "first_diff_vs_eager": [next((i for i, (a, b) in enumerate(zip(p, g)) if a != b), None)
                                    for p, g in zip(toks["eager"], toks[fast])]}
    a, _ = run(fast, 4, sampled)
    b, _ = run(fast, 4, sampled)
    single = [run(fast, 1, sampled)[0][0]]
    out[f"{dtype}_sampled"] = {"same_seed_same_tokens": [x.generated_ids for x in a] == [x.generated_ids for x in b],
                               "row0_batch4_eq_batch1": a[0].generated_ids == single[0].generated_ids,
                               "differs_from_greedy": a[0].generated_ids != toks[fast][0]}
    print("tiny", json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    t0 = time.time()
    kernels.configure(decode_graphs="on")
    info: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                  "kv": AR_KV, "span_step": SPAN_STEP}
    if not args.skip_tiny:
        info["tiny"] = {**tiny_ar("bfloat16"), **tiny_ar("float32")}
    with torch.no_grad():
        info["attention"] = attention_micro(sorted({1, 8, 16, 32, 64} | {int(b) for b in args.batches.split(",")}))
    model = build_stack(args.layers)
    info["stack"] = stack_decode(model, [int(b) for b in args.batches.split(",")])
    try:
        info["hazard"] = autocast_cache_hazard(model)
    except Exception as e:  # noqa: BLE001 - a diagnosis, not the benchmark
        info["hazard"] = {"error": repr(e)}
    info["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    info["wall_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    print(f"\n{info['device']}, {args.layers} layers, KV {AR_KV}, per layer (ms); floor at "
          f"{info['stack']['copy_bandwidth_TBps']:.2f} TB/s measured copy bandwidth")
    print(f"{'batch':>5} {'plain':>7} {'static':>7} {'graph':>7} {'full-cap':>8} {'floor':>6} {'%floor':>6} "
          f"{'g==e':>5} {'vs plain':>9} {'step ms':>8}")
    for b in args.batches.split(","):
        r = info["stack"][f"b{b}"]
        print(f"{b:>5} {r['plain_eager_ms']:7.3f} {r['static_eager_ms']:7.3f} {r['graph_ms']:7.3f} "
              f"{r['graph_full_capacity_ms']:8.3f} {r['floor_ms']:6.3f} {r['graph_pct_of_floor']:6.1f} "
              f"{str(r['graph_equals_eager_bitwise']):>5} {r['static_vs_plain_rel']:9.2e} "
              f"{r['graph_full_step_ms']:8.2f}")


if __name__ == "__main__":
    main()
