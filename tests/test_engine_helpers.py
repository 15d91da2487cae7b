"""Shared helpers for the engine tests (no tests here).

The tiny engine is loaded once per test process (`tiny_engine()` is cached) and shared by every
`tests/test_engine_*.py` module; tests must not mutate it (they copy KV before corrupting it).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image


@functools.cache
def tiny_engine():
    from components.engine import Engine

    return Engine.load("tiny", seed=0)


def keep_cot_in_tokenizer(engine, monkeypatch) -> None:
    """Sample the CoT from the tokenizer's ids only. Ids past the tokenizer's length are sampled
    (as officially) but vanish from the re-encoded CoT, and with them the decoded tokens' K/V from
    the exported (reused) prefix; tests that compare those K/V keep them in."""
    import torch

    logits, known = engine.model.text_logits, engine.tokenizer.vocab_size
    monkeypatch.setattr(engine.model, "text_logits", lambda h: logits(h).index_fill(
        -1, torch.arange(known, engine.model.config.vocab_size, device=h.device), float("-inf")))


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB noise image with some low-frequency structure."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 255 // max(width - 1, 1)), (yy * 255 // max(height - 1, 1)),
                     ((xx + yy) * 127 // max(width + height - 2, 1))], axis=-1)
    noise = rng.integers(-40, 41, (height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def psnr(a: Image.Image | np.ndarray, b: Image.Image | np.ndarray) -> float:
    """PSNR in dB of two uint8 images (inf when identical)."""
    x = np.asarray(a)
    y = np.asarray(b)
    assert x.dtype == np.uint8 and y.dtype == np.uint8, (x.dtype, y.dtype)
    assert x.shape == y.shape, (x.shape, y.shape)
    mse = np.mean((x.astype(np.float64) - y.astype(np.float64)) ** 2)
    if mse == 0:
        return math.inf
    return 10.0 * math.log10(255.0 ** 2 / mse)


def stub_vae_decode(monkeypatch) -> None:
    """For tests that only compare latents / kv_path: skip the VAE decode (most of a tiny DiT call)."""
    from components.engine.dit import DiTGenerator

    monkeypatch.setattr(DiTGenerator, "decode", lambda self, latents: Image.new("RGB", (16, 16)))


def script_sampled_tokens(monkeypatch, next_token) -> None:
    """Every token the AR samples becomes `next_token()` (the scheduler's DeviceSampler keeps its
    greedy ratio choice; forced tokens are never sampled, so they consume nothing)."""
    from components.engine.kernels.decode import DeviceSampler

    real = DeviceSampler.__call__

    def scripted(self, logits, sample_rows, generators=None):
        picks = real(self, logits, sample_rows, generators)
        return [(ratio, next_token() if draw else token) for (ratio, token), draw in zip(picks, sample_rows)]

    monkeypatch.setattr(DeviceSampler, "__call__", scripted)
