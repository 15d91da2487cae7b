"""The prompt K/V that the AR step hands to the DiT step.

This is the engine-side object; `components/kvstore/payload.py` turns it into bytes and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptKV:
    """Per-layer K and V of the conditional row's prefix, exactly as attention consumed them.

    keys[i] / values[i]: [num_tokens, num_kv_heads, head_dim] for layer i (keys post-RoPE and
    post-QK-norm). `token_ids` are the tokens these K/V belong to; `pos_reuse_len` equals
    len(token_ids): the DiT injects them for the positive row. `neg_reuse_len` is the index of
    the unconditional row's first `<cfg>`: the uncond row shares K/V[:neg_reuse_len].
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: list[int]
    pos_reuse_len: int
    neg_reuse_len: int
    model_id: str = ""
    config_hash: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def validate(self) -> None:
        """Raise ValueError if the shapes and boundaries do not describe one consistent prefix."""
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("keys and values must be non-empty and have one entry per layer")
        n = len(self.token_ids)
        if self.pos_reuse_len != n:
            raise ValueError(f"pos_reuse_len {self.pos_reuse_len} != number of token ids {n}")
        if not 0 < self.neg_reuse_len <= self.pos_reuse_len:
            raise ValueError(f"neg_reuse_len {self.neg_reuse_len} not in (0, {self.pos_reuse_len}]")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.shape != v.shape or k.dim() != 3 or k.shape[0] != n:
                raise ValueError(f"layer {i}: K {tuple(k.shape)} / V {tuple(v.shape)} do not match {n} tokens")
