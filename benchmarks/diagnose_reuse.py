"""Diagnose reuse-vs-recompute drift on a device: compare the AR-exported prefix K/V with the
DiT's own prefill of the same tokens, layer by layer, under different SDPA backends."""

from __future__ import annotations

import sys

import torch

from components.engine import ARRequest, DiTRequest, Engine, SamplingParams


def main(device: str = "cuda", dtype: str = "float32") -> None:
    eng = Engine.load("tiny", device=device, dtype=dtype)
    ar = eng.generate_ar([ARRequest("t2i", "make the sky purple", [])], SamplingParams(max_new_tokens=16))[0]
    dit = eng.dit
    seq = ar.dit_sequence(dit.builder)
    for backend in ("default", "math"):
        ctx = (torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]) if backend == "math"
               else torch.enable_grad())
        with ctx, torch.no_grad():
            cache = dit.prefix_from_scratch(seq, [], cfg_on=False)
            n = seq.pos_reuse_len
            for layer in range(len(cache.k)):
                k_dit = cache.k[layer][0, :, :n].transpose(0, 1).float().cpu()
                k_ar = ar.prompt_kv.keys[layer].float().cpu()
                diff = (k_dit - k_ar).abs().amax(dim=(1, 2))
                worst = int(diff.argmax())
                print(f"{backend} layer {layer}: max|dK|={diff.max():.3e} at token {worst} "
                      f"(prompt len {len(ar.prompt_ids)}, reuse len {n}); first>1e-3: "
                      f"{int((diff > 1e-3).nonzero()[0]) if (diff > 1e-3).any() else None}")
            full_re = dit.prefix_from_scratch(seq, [], cfg_on=True)
            full_ru = dit.prefix_from_reuse(seq, ar.prompt_kv, [], cfg_on=True)
            for row in (0, 1):
                d = max((a[row] - b[row]).abs().max().item() for a, b in zip(full_re.k + full_re.v, full_ru.k + full_ru.v))
                print(f"{backend} full prefix row {row} (0 cond, 1 uncond): max |d| = {d:.3e}")
            r1 = dit(DiTRequest(ar, [], ar.prompt_kv, steps=8, seed=1))
            r2 = dit(DiTRequest(ar, [], None, steps=8, seed=1))
            r3 = dit(DiTRequest(ar, [], None, steps=8, seed=1))
            print(backend, "latent max diff reuse-recompute", (r1.latents - r2.latents).abs().max().item(),
                  "recompute-recompute", (r2.latents - r3.latents).abs().max().item())


if __name__ == "__main__":
    main(*sys.argv[1:])
