"""The demo training script's pieces that need no training run (the whole script: a CPU smoke run,
see components/demo/train.py)."""

from __future__ import annotations

import torch

from components.demo import train


def test_dense_experts_equal_the_loop():
    """`--moe dense` (every expert on every token, weight 0 where not routed, no host sync) gives
    the per-expert loop's output and gradients."""
    torch.manual_seed(0)
    n, hidden, inter, experts = 200, 32, 24, 4
    x = torch.randn(n, hidden, requires_grad=True)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.1).requires_grad_()
    w_down = (torch.randn(experts, hidden, inter) * 0.1).requires_grad_()
    logits = torch.randn(n, experts, requires_grad=True)
    results = []
    for fn in (train.moe_loop_autocast, train.moe_dense_autocast):
        weights, chosen = torch.softmax(logits, -1).topk(2, dim=-1)
        out = fn(x, weights / weights.sum(-1, keepdim=True), chosen, w_gate_up, w_down)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, hidden)).sum(), (x, w_gate_up, w_down, logits))
        results.append((out, grads))
    (loop, loop_grads), (dense, dense_grads) = results
    assert dense.dtype == loop.dtype == torch.float32
    torch.testing.assert_close(dense, loop, atol=1e-5, rtol=1e-5)
    for a, b in zip(dense_grads, loop_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_staged_copy_on_cpu_is_plain():
    t = torch.arange(5)
    assert train.Staged("cpu")(t).equal(t)
