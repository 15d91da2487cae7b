"""MoE: routing (softmax, top-k, renormalised), grouped GEMM and fused dispatch vs per-expert loop, no
dropped tokens. The fused path's compiled pieces run eagerly on the CPU (the same formulas); the GPU
comparison is benchmarks/moe_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.engine import kernels
from components.engine.config import tiny_config
from components.engine.kernels.moe import choose_impl, combine_sorted, inverse_order, moe_fused, sort_by_expert
from components.engine.transformer import MoE, moe_grouped, moe_loop

H, I, E, K = 16, 8, 6, 2


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, torch.randn(E, H, I, generator=g) * I ** -0.5)


def _expert(x, w_gate_up, w_down):
    """One SwiGLU expert written out: down(x1 * silu(x2)), [x1 | x2] = gate_and_up(x)."""
    h = x @ w_gate_up.T
    return (h[..., :I] * F.silu(h[..., I:])) @ w_down.T


def _uneven_routing(n: int, seed: int = 1):
    """Top-2 assignments with very uneven loads: expert 0 gets most tokens, expert 4 none, 5 one."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.zeros(n, K, dtype=torch.long)
    experts[:, 0] = 0
    experts[:, 1] = torch.randint(1, 4, (n,), generator=g)  # experts 1..3
    experts[3] = torch.tensor([5, 0])  # expert 5: exactly one token, in slot 0
    experts[7] = torch.tensor([2, 1])  # a token not routed to expert 0 at all
    w = torch.rand(n, K, generator=g) + 0.05
    return experts, w / w.sum(-1, keepdim=True)


def _reference(x, weights, experts, w_gate_up, w_down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[t, s])
            out[t] += weights[t, s] * _expert(x[t], w_gate_up[e], w_down[e])
    return out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("impl", [moe_loop, moe_grouped, moe_fused])
def test_moe_paths_match_per_token_reference(impl):
    n = 37
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, H, generator=g)
    experts, weights = _uneven_routing(n)
    counts = torch.bincount(experts.reshape(-1), minlength=E).tolist()
    assert counts[4] == 0 and counts[5] == 1 and counts[0] == n - 1  # the loads are uneven as intended
    wgu, wd = _weights()
    out = impl(x, weights, experts, wgu, wd)
    ref = _reference(x, weights, experts, wgu, wd)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _rel(out, ref) <= 1e-5
    # every token got its routed experts' contribution (none dropped, even past any "capacity")
    per_token = (out - ref).abs().max(-1).values
    assert (per_token <= 1e-5 * ref.abs().max()).all()
    assert (ref.abs().sum(-1) > 0).all()


def test_moe_grouped_matches_loop():
    n = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, H, generator=g)
    experts, weights = _uneven_routing(n, seed=4)
    wgu, wd = _weights(5)
    a = moe_grouped(x, weights, experts, wgu, wd)
    b = moe_loop(x, weights, experts, wgu, wd)
    assert _rel(a, b) <= 1e-5


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_config().replace(hidden_size=H, moe_intermediate_size=I, num_experts=E, moe_topk=K)
    torch.manual_seed(0)
    m = MoE(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return m


def test_routing_softmax_topk_renormalised(moe):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(50, H, generator=g)
    weights, experts = moe.route(x)
    assert weights.shape == experts.shape == (50, K)
    assert torch.allclose(weights.sum(-1), torch.ones(50), atol=1e-6)
    logits = x @ moe.gate.wg.weight.T
    for t in range(50):
        probs = torch.softmax(logits[t].double(), -1)
        top = sorted(range(E), key=lambda e: -probs[e].item())[:K]
        assert experts[t].tolist() == top
        expected = [probs[e].item() / sum(probs[f].item() for f in top) for e in top]
        assert weights[t].tolist() == pytest.approx(expected, rel=1e-5)
        assert len(set(experts[t].tolist())) == K


@pytest.mark.parametrize("impl", ["loop", "grouped", "fused"])
def test_moe_forward_equals_dense_reference(moe, impl):
    """Dense reference: run every expert on every token, combine with the renormalised top-k weights
    (zero for the rest), plus the shared SwiGLU MLP."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 11, H, generator=g)
    moe.impl = impl  # instance attribute: the class default is untouched
    try:
        out = moe(x)
    finally:
        del moe.impl
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat @ moe.gate.wg.weight.T, -1)
    top = probs.topk(K, -1)
    combine = torch.zeros_like(probs).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    dense = torch.stack([_expert(flat, moe.experts.gate_and_up_proj[e], moe.experts.down_proj[e])
                         for e in range(E)], 1)  # [N, E, H]
    routed = (combine.unsqueeze(-1) * dense).sum(1)
    sw = moe.shared_mlp
    h = flat @ sw.gate_and_up_proj.weight.T
    shared = (h[:, :I] * F.silu(h[:, I:])) @ sw.down_proj.weight.T
    ref = (routed + shared).view_as(x)
    assert _rel(out, ref) <= 1e-5
    # the routed part is a real contribution (not swamped by the shared expert)
    assert routed.abs().max() > 0.1 * shared.abs().max()


def test_moe_impl_auto_uses_loop_on_cpu(moe, monkeypatch):
    calls = []
    import components.engine.transformer as tr

    real = tr.moe_loop
    monkeypatch.setattr(tr, "moe_loop", lambda *a: calls.append("loop") or real(*a))
    moe(torch.randn(2, 3, H))
    assert calls == ["loop"]


# --------------------------------------------------------------------------- fused dispatch pieces
def test_sort_by_expert_matches_bincount_offsets():
    experts, _ = _uneven_routing(41, seed=9)
    order, token, offs = sort_by_expert(experts, E)
    flat = experts.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(token, order // K)
    assert offs.dtype == torch.int32
    assert torch.equal(offs, torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32))
    assert offs[4] == offs[3] and offs[5] - offs[4] == 1  # an empty group and a one-row group
    inv = inverse_order(order)
    assert torch.equal(order[inv], torch.arange(flat.numel()))


def test_combine_sorted_pairs_each_slot_with_its_weight():
    n, h = 9, 5
    g = torch.Generator().manual_seed(10)
    experts, weights = _uneven_routing(n, seed=11)
    per_slot = torch.randn(n, K, h, generator=g)  # (token, slot) order
    order, _, _ = sort_by_expert(experts, E)
    y = per_slot.reshape(n * K, h)[order]  # expert order, as the grouped GEMM writes it
    out = combine_sorted(y, inverse_order(order), weights)
    ref = (weights.unsqueeze(-1) * per_slot).sum(1)
    assert torch.allclose(out, ref, atol=1e-6)
    swapped = combine_sorted(y, inverse_order(order), weights.flip(1))  # negative control
    assert not torch.allclose(swapped, ref, atol=1e-3)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_moe_fused_matches_grouped(dtype, tol):
    """Same GEMMs; the fused path rounds SwiGLU once and keeps the combine weights fp32."""
    n = 64
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, H, generator=g).to(dtype)
    experts, weights = _uneven_routing(n, seed=13)
    wgu, wd = (w.to(dtype) for w in _weights(14))
    a = moe_fused(x, weights, experts, wgu, wd)
    b = moe_grouped(x, weights, experts, wgu, wd)
    assert a.dtype == dtype
    assert _rel(a.float(), b.float()) <= tol


def test_kernel_setting_selects_the_moe_path(moe, monkeypatch):
    import components.engine.transformer as tr

    x = torch.randn(2, 3, H)
    assert choose_impl(x) == "loop"  # auto on the CPU
    calls = []
    monkeypatch.setattr(tr, "moe_fused", lambda *a: calls.append("fused") or moe_fused(*a))
    previous = kernels.configure(moe="fused")
    try:
        assert choose_impl(x) == "fused"
        moe(x)
    finally:
        kernels.configure(previous)
    assert calls == ["fused"]


def _rank_halves(moe):
    """The two tensor-parallel ranks' MoEs (experts split in halves), as one process can run them
    (the all-reduce that sums them is left out: world size 1, the test sums)."""
    from components.engine.parallel import ParallelMoE
    from components.runtime.parallel import ParallelContext

    ctx = ParallelContext(rank=0, world_size=1, device=torch.device("cpu"))
    halves = []
    for first, count in ((0, E // 2), (E // 2, E - E // 2)):
        half = ParallelMoE(moe, ctx, first, count, shared=None).eval()
        with torch.no_grad():
            half.experts.gate_and_up_proj.copy_(moe.experts.gate_and_up_proj[first:first + count])
            half.experts.down_proj.copy_(moe.experts.down_proj[first:first + count])
        halves.append(half)
    return halves


@pytest.mark.parametrize("tokens", [5, 256, 257, 600])
def test_tensor_parallel_experts_sum_to_the_whole_moe(moe, tokens):
    """Each rank's experts (decode-size batches at static shapes, larger ones sparse) sum to the
    routed output of the whole MoE."""
    from components.engine.parallel import STATIC_ROUTING_TOKENS

    assert (tokens <= STATIC_ROUTING_TOKENS) == (tokens <= 256)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    weights, experts = moe.route(x)
    whole = moe_loop(x, weights, experts, moe.experts.gate_and_up_proj, moe.experts.down_proj)
    with torch.no_grad():
        summed = sum(half(x) for half in _rank_halves(moe))
    assert _rel(summed, whole) <= 1e-5


def test_a_decode_size_batch_splits_experts_without_a_host_sync(moe):
    """At decode sizes a rank's MoE has no data-dependent shape: no nonzero and no read back to the
    host (which a CUDA graph cannot hold; tensor-parallel decode graphs failed on it on the GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    previous = kernels.configure(moe="fused")  # the routed experts' own path syncs nowhere either
    try:
        half = _rank_halves(moe)[1]
        x = torch.randn(8, H, generator=torch.Generator().manual_seed(3))
        with torch.no_grad(), Ops() as ops:
            half(x)
        syncing = {name for name in ops.names if name.startswith(("nonzero", "_local_scalar_dense", "item"))}
        assert not syncing, syncing
        with torch.no_grad(), Ops() as ops:
            half(torch.randn(300, H))  # the sparse path above decode sizes: it does read back
        assert any(name.startswith("nonzero") for name in ops.names)
    finally:
        kernels.configure(previous)
