"""MoE dispatch at full size on one GPU (bf16, dummy weights), and the cost of `--batch-invariant`.

Part 1, one MoE layer (hidden 4096, 64 experts top-8 of width 3072, shared expert 3072) at the DiT
cached-step shape (2 x 3954 tokens) and at AR decode batches 1 / 8 / 64:
    bare grouped GEMMs   the two torch._grouped_mm calls alone, inputs prepared beforehand
    routed grouped/fused route + dispatch + GEMMs + combine (MoE.route then moe_grouped / moe_fused)
    whole grouped/fused  MoE.forward (routed + shared expert; fused runs the shared one on a side stream)
    fused, CUDA graph    the whole fused MoE captured in a CUDA graph (capture fails on a host sync)
overhead % = (time - bare GEMMs [- shared expert alone]) / bare GEMMs; rel err = ||a-b|| / ||b||, fused
vs grouped, and each against the same routed experts computed in fp32 (per-expert loop).

Part 2, batch invariance: the tiny model's AR on the GPU (bf16), 8 rows as one batch vs each row
alone (batch_invariant=on), plus a check that a row's tokens and K/V are bitwise the same in two
batches; and one full-width decoder layer's decode step at batch 1 and 8 (KV 6.8k), from which the
decode cost of running 8 rows one by one is projected.

    python benchmarks/moe_kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

from benchmarks.engine_layers import AR_KV, build_stack
from benchmarks.engine_layers import cuda_time as cuda_ms

from components.engine import kernels
from components.engine.kernels import moe as moe_kernels
from components.engine.kernels.compiled import call_compiled, compile_failures
from components.engine.kernels.moe import combine_sorted, inverse_order, moe_fused, sort_by_expert, swiglu
from components.engine.transformer import MoE, _swiglu, moe_grouped, moe_loop

SHAPES = {"dit": 2 * 3954, "b1": 1, "b8": 8, "b64": 64}
DEVICE = "cuda"
PROFILE = ""  # where the DiT-shape kernel profile of the fused MoE goes (--profile)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def with_impl(moe: MoE, impl: str):
    def run(x):
        moe.impl = impl
        try:
            return moe(x)
        finally:
            del moe.impl
    return run


@torch.no_grad()
def bench_moe(moe: MoE, n: int) -> dict:
    hidden = moe.experts.down_proj.shape[1]
    w1, w2 = moe.experts.gate_and_up_proj, moe.experts.down_proj
    x = torch.randn(n, hidden, device=DEVICE, dtype=torch.bfloat16)
    reps = dict(warmup=3, repeat=7) if n > 1000 else dict(warmup=5, repeat=30)
    w, e = moe.route(x)
    order, token, offs = sort_by_expert(e, w1.shape[0])
    xs = x[token]
    a = swiglu(torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs))
    r: dict = {"tokens": n, "experts_used": int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())}
    r["bare_gemms_ms"] = cuda_ms(lambda: (torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs),
                                          torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)), **reps)
    r["shared_expert_ms"] = cuda_ms(lambda: moe.shared_mlp(x), **reps)
    r["route_ms"] = cuda_ms(lambda: moe.route(x), **reps)
    r["routed_grouped_ms"] = cuda_ms(lambda: moe_grouped(x, *moe.route(x), w1, w2), **reps)
    r["routed_fused_ms"] = cuda_ms(lambda: moe_fused(x, *moe.route(x), w1, w2), **reps)
    grouped, fused = with_impl(moe, "grouped"), with_impl(moe, "fused")
    r["whole_grouped_ms"] = cuda_ms(lambda: grouped(x), **reps)
    r["whole_fused_ms"] = cuda_ms(lambda: fused(x), **reps)
    threshold = moe_kernels.SIDE_STREAM_MIN_TOKENS
    moe_kernels.SIDE_STREAM_MIN_TOKENS = 1 if threshold > n else 1 << 62  # the other choice, for comparison
    r["whole_fused_other_stream_choice_ms"] = cuda_ms(lambda: fused(x), **reps)
    moe_kernels.SIDE_STREAM_MIN_TOKENS = threshold
    r["side_stream_used"] = n >= threshold
    if n > 1000:  # where the time goes in the fused path
        h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        inv = inverse_order(order)
        r["piece_sort_ms"] = cuda_ms(lambda: sort_by_expert(e, w1.shape[0]), **reps)
        r["piece_gather_ms"] = cuda_ms(lambda: x.index_select(0, token), **reps)
        r["piece_swiglu_compiled_ms"] = cuda_ms(lambda: call_compiled(swiglu, h), **reps)
        r["piece_swiglu_eager_bf16_ms"] = cuda_ms(lambda: _swiglu(h), **reps)
        r["piece_inverse_order_ms"] = cuda_ms(lambda: inverse_order(order), **reps)
        r["piece_combine_compiled_ms"] = cuda_ms(lambda: call_compiled(combine_sorted, y, inv, w, dynamic=3), **reps)
    # accuracy: routed fused vs grouped (the same GEMMs), grouped vs loop (bitwise today)
    rg, rf = moe_grouped(x, w, e, w1, w2), moe_fused(x, w, e, w1, w2)
    r["fused_vs_grouped_rel_err"] = rel(rf, rg)
    r["fused_vs_grouped_bitwise"] = bool(torch.equal(rf, rg))
    r["fused_rerun_bitwise"] = bool(torch.equal(rf, moe_fused(x, w, e, w1, w2)))
    r["grouped_vs_loop_bitwise"] = bool(torch.equal(rg, moe_loop(x, w, e, w1, w2)))
    r["whole_fused_vs_grouped_rel_err"] = rel(fused(x), grouped(x))
    ref = moe_loop(x.float(), w, e, w1.float(), w2.float())  # which rounds less: against fp32 math
    r["fused_vs_fp32_rel_err"], r["grouped_vs_fp32_rel_err"] = rel(rf, ref), rel(rg, ref)
    del ref
    # CUDA graphs of the whole MoE: no host sync on the hot path, or the capture fails
    for name, run in (("fused", fused), ("grouped", grouped)):
        try:
            static_x = x.clone()
            run(static_x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = run(static_x)
            graph.replay()
            torch.cuda.synchronize()
            r[f"graph_vs_eager_{name}_bitwise"] = bool(torch.equal(static_out, run(x)))
            r[f"whole_{name}_graph_ms"] = cuda_ms(graph.replay, **reps)
            del graph, static_out
        except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
            r[f"graph_{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if n > 1000 and PROFILE:  # kernel by kernel, the GPU's own times
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fused(x)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        try:
            text = averages.table(sort_by="device_time_total", row_limit=25)
        except Exception:  # noqa: BLE001 - older name of the column
            text = averages.table(sort_by="cuda_time_total", row_limit=25)
        with open(PROFILE, "w") as f:
            f.write(text)
    g = r["bare_gemms_ms"]
    for name in ("routed_grouped", "routed_fused"):
        r[f"{name}_overhead_pct"] = 100 * (r[f"{name}_ms"] - g) / g
    for name in ("whole_grouped", "whole_fused", "whole_fused_graph", "whole_grouped_graph",
                 "whole_fused_other_stream_choice"):
        if f"{name}_ms" in r:
            r[f"{name}_overhead_pct"] = 100 * (r[f"{name}_ms"] - g - r["shared_expert_ms"]) / g
    return r


def _ar_rows():
    from components.engine import ARRequest

    prompts = ["a cat", "a red fox in the snow, photographed at dawn", "make it look like an oil painting",
               "a watercolor painting of a golden horse near a river at sunset, with soft light and long shadows",
               "a city skyline at night", "two robots playing chess in a park, children watching",
               "a bowl of ramen, top view", "an old lighthouse on a cliff during a storm, waves crashing below"]
    return [ARRequest(f"r{i}", p, [], bot_task="think_recaption", seed=i) for i, p in enumerate(prompts)]


def _same_kv(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.prompt_kv.keys + a.prompt_kv.values,
                                                 b.prompt_kv.keys + b.prompt_kv.values))


@torch.no_grad()
def bench_batch_invariance(max_new_tokens: int) -> dict:
    from components.engine import ARRequest, Engine, SamplingParams

    eng = Engine.load("tiny", device=DEVICE, dtype="bfloat16", seed=0)
    sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    out: dict = {"model": "tiny", "rows": 8, "max_new_tokens": max_new_tokens}
    for mode in ("off", "on"):
        prev = kernels.configure(batch_invariant=mode)
        try:
            eng.generate_ar(_ar_rows(), sp)  # warm-up (compiles)
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = eng.generate_ar(_ar_rows(), sp)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[f"ar_8rows_{mode}_s"] = statistics.median(times)
            out[f"generated_tokens_{mode}"] = sum(len(o.generated_ids) for o in res)
            # every row: batched (8) vs alone, and r1 among other neighbours
            alone = [eng.generate_ar([r], sp)[0] for r in _ar_rows()]
            out[f"rows_tokens_differ_batched_vs_alone_{mode}"] = sum(
                x.generated_ids != y.generated_ids for x, y in zip(res, alone))
            out[f"rows_kv_differ_batched_vs_alone_{mode}"] = sum(
                not _same_kv(x, y) for x, y in zip(res, alone) if x.generated_ids == y.generated_ids)
            # the same row (r1) in two batches of other neighbours, left-padded to other lengths
            rows = _ar_rows()
            a = eng.generate_ar(rows[:5], sp)[1]
            b = eng.generate_ar([rows[5], rows[1], ARRequest("x", "a tiny house", [], bot_task="think_recaption",
                                                              seed=99)], sp)[1]
            assert a.id == b.id == "r1"
            out[f"row_tokens_equal_{mode}"] = a.generated_ids == b.generated_ids
            n = min(a.prompt_kv.pos_reuse_len, b.prompt_kv.pos_reuse_len)
            pairs = list(zip(a.prompt_kv.keys + a.prompt_kv.values, b.prompt_kv.keys + b.prompt_kv.values))
            out[f"row_kv_bitwise_{mode}"] = all(torch.equal(x[:n], y[:n]) for x, y in pairs)
            out[f"row_kv_max_diff_{mode}"] = max((x[:n].float() - y[:n].float()).abs().max().item() for x, y in pairs)
        finally:
            kernels.configure(prev)
    out["cost_x"] = out["ar_8rows_on_s"] / out["ar_8rows_off_s"]
    return out


@torch.no_grad()
def bench_decode_layer(model) -> dict:
    """One full-width decoder layer, one decode step over AR_KV cached tokens, batch 1 and 8."""
    hidden, out = model.config.hidden_size, {}
    for b in (1, 8):
        cache = model.new_cache(b, AR_KV + 1)
        cache.length = AR_KV
        mask = torch.ones(b, 1, 1, AR_KV + 1, dtype=torch.bool, device=DEVICE)
        pos = torch.full((b, 1, 2), float(AR_KV), dtype=torch.float64, device=DEVICE)
        x = torch.randn(b, 1, hidden, device=DEVICE, dtype=torch.bfloat16)
        out[f"decode_b{b}_ms"] = cuda_ms(lambda: model.forward_layers(x, pos, mask, cache), warmup=5, repeat=30)
        del cache
    out["decode_8_rows_one_by_one_vs_batched_x"] = 8 * out["decode_b1_ms"] / out["decode_b8_ms"]
    return out


def guarded(res: dict, name: str, fn, *args) -> None:
    t0 = time.time()
    try:
        res[name] = fn(*args)
    except Exception:  # noqa: BLE001 - one failing part must not lose the others
        res[name] = {"error": traceback.format_exc()[-2000:]}
    res[name + "_wall_s"] = round(time.time() - t0, 1)
    print(name, json.dumps(res[name]), flush=True)


def table(res: dict) -> str:
    nan = float("nan")
    lines = [f"device {res['device']}, torch {res['torch']}; kernels {res['kernels']}",
             f"{'shape':6} {'gemms':>7} {'shared':>7} {'route':>6} {'r.grp':>7} {'r.fus':>7} {'ovh grp':>8} "
             f"{'ovh fus':>8} {'W.grp':>7} {'W.fus':>7} {'G.grp':>7} {'G.fus':>7} {'ovhG fus':>8} {'rel err':>8}"]
    for s in SHAPES:
        r = res.get(f"moe_{s}", {})
        if "bare_gemms_ms" not in r:
            lines.append(f"{s:6} failed")
            continue
        lines.append(f"{s:6} {r['bare_gemms_ms']:7.3f} {r['shared_expert_ms']:7.3f} {r['route_ms']:6.3f} "
                     f"{r['routed_grouped_ms']:7.3f} {r['routed_fused_ms']:7.3f} "
                     f"{r['routed_grouped_overhead_pct']:7.1f}% {r['routed_fused_overhead_pct']:7.1f}% "
                     f"{r['whole_grouped_ms']:7.3f} {r['whole_fused_ms']:7.3f} "
                     f"{r.get('whole_grouped_graph_ms', nan):7.3f} {r.get('whole_fused_graph_ms', nan):7.3f} "
                     f"{r.get('whole_fused_graph_overhead_pct', nan):7.1f}% {r['fused_vs_grouped_rel_err']:8.1e}")
    lines.append("(ms; r. = route + routed experts; W. = whole MoE incl. shared expert, eager; G. = the same in a "
                 "CUDA graph; ovh = over bare GEMMs [whole: minus the shared expert alone])")
    bi = res.get("batch_invariance", {})
    if "cost_x" in bi:
        lines.append(f"batch-invariant AR, tiny bf16, 8 rows x {bi['max_new_tokens']} tokens: batched "
                     f"{bi['ar_8rows_off_s']:.3f} s, one by one {bi['ar_8rows_on_s']:.3f} s ({bi['cost_x']:.2f}x); "
                     f"row bitwise across batches: off tokens={bi['row_tokens_equal_off']} kv={bi['row_kv_bitwise_off']} "
                     f"(max diff {bi['row_kv_max_diff_off']:.3g}), on tokens={bi['row_tokens_equal_on']} "
                     f"kv={bi['row_kv_bitwise_on']}")
        lines.append(f"  8 rows batched vs each alone: rows with other tokens off/on "
                     f"{bi['rows_tokens_differ_batched_vs_alone_off']}/{bi['rows_tokens_differ_batched_vs_alone_on']}, "
                     f"rows with other K/V (same tokens) off/on {bi['rows_kv_differ_batched_vs_alone_off']}/"
                     f"{bi['rows_kv_differ_batched_vs_alone_on']}")
    d = res.get("decode_layer", {})
    if "decode_b1_ms" in d:
        lines.append(f"full-width layer decode KV 6.8k: b1 {d['decode_b1_ms']:.3f} ms, b8 {d['decode_b8_ms']:.3f} ms "
                     f"-> 8 rows one by one {d['decode_8_rows_one_by_one_vs_batched_x']:.2f}x the batched decode")
    lines.append(f"compile failures: {res.get('compile_failures') or 'none'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: moe, batch, decode")
    parser.add_argument("--profile", default="", help="write the fused MoE's kernel profile (DiT shape) here")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "kernels": kernels.settings().describe()}
    model = build_stack(1)
    if "moe" not in skip:
        moe = model.model.layers[0].mlp
        for s, n in SHAPES.items():
            guarded(res, f"moe_{s}", bench_moe, moe, n)
    if "decode" not in skip:
        guarded(res, "decode_layer", bench_decode_layer, model)
    del model
    torch.cuda.empty_cache()
    if "batch" not in skip:
        guarded(res, "batch_invariance", bench_batch_invariance, args.max_new_tokens)
    res["compile_failures"] = dict(compile_failures)
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
