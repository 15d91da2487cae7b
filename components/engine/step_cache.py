"""First-block step cache for the DiT (opt-in, approximate): skip the deep layers on steps where
the first layer's output barely moved.

Between neighbouring denoising steps most of the decoder's work repeats. At each step the first
decoder layer always runs; its residual (output - input) is compared with the residual of the last
step that ran every layer:

    change = mean |r1 - r1_ref| / mean |r1_ref|
    change <  threshold  ->  hidden = first layer's output + the deep layers' residual cached then
    otherwise            ->  run all layers; r1_ref and the deep residual are refreshed

(the first-block cache of ParaAttention / TeaCache's idea with the first block as the indicator).
The first `warmup` steps always run in full. Never on by default: the accuracy sweep measures
speed-up against PSNR/SSIM of the exact path (examples/sweeps/step_cache.yaml). Under tensor
parallelism every rank holds the same hidden states after the first layer's all-reduce, so all
ranks of a group take the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FirstBlockCache:
    threshold: float
    warmup: int = 1
    reference: torch.Tensor | None = None  # first-layer residual of the last full step
    deep_residual: torch.Tensor | None = None  # (last hidden - first-layer output) of that step
    steps: int = 0
    skipped: int = 0

    def forward(self, model, x: torch.Tensor, positions: torch.Tensor, mask, cache,
                compiled: bool = False) -> torch.Tensor:
        """model.forward_layers over x, skipping layers 1.. when the first layer's residual moved
        less than the threshold since the last full step."""
        n = model.config.num_hidden_layers
        first = model.forward_layers(x, positions, mask, cache, compiled=compiled, layers=range(0, 1))
        residual = first - x
        self.steps += 1
        if self.steps > self.warmup and self.reference is not None and self._change(residual) < self.threshold:
            self.skipped += 1
            return first + self.deep_residual
        hidden = model.forward_layers(first, positions, mask, cache, compiled=compiled, layers=range(1, n))
        self.reference, self.deep_residual = residual, hidden - first
        return hidden

    def _change(self, residual: torch.Tensor) -> float:
        ref = self.reference.float()
        return float((residual.float() - ref).abs().mean() / ref.abs().mean().clamp_min(1e-12))
