"""DiT stage: flow-matching Euler denoising with CFG, from recomputed or reused prompt K/V.

    prefix K/V  = recompute: the whole prefix [cond; uncond] in one forward (denoise step 1)
                  reuse:     AR K/V[:pos] + prefill of the cond row's rest, and
                             AR K/V[:neg] + prefill of the uncond row from its first <cfg>
    for t in timesteps:      only <timestep> + image tokens are computed, over the cached prefix
        v = uncond + g * (cond - uncond)
        latents = scheduler.step(v, t, latents)
    image = vae.decode(latents)

Both CFG rows have exactly the prefix length, so there are no padded slots and no masks over
fake tokens; conditioning images live inside the reused prefix. Tokens after the image
(`<eoi></answer>`) cannot influence image tokens (they come later in a causal order) and are not
computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from PIL import Image

from .ar import AROutput, request_seed
from .inputs import EncodedImage, embed_span, encode_cond_images
from .kvcache import PromptKV
from .sequence import Sequence, SequenceBuilder, first_difference
from .transformer import HeadMask, HunyuanImage3ForCausalMM, KVCache, attention_mask


@dataclass
class DiTRequest:
    ar: AROutput
    images: list[Image.Image] = field(default_factory=list)  # the same conditioning images the AR saw
    prompt_kv: PromptKV | None = None
    absent_reason: str = ""  # why prompt_kv is None, when the KV store had none
    steps: int = 20
    guidance_scale: float = 5.0
    flow_shift: float = 3.0
    seed: int | None = None


@dataclass
class DiTOutput:
    id: str
    image: Image.Image
    latents: torch.Tensor
    kv_path: str  # "reuse" | "recompute"
    kv_reason: str  # why recompute ("" on reuse)
    timings: dict = field(default_factory=dict)


class DiTGenerator:
    def __init__(self, model: HunyuanImage3ForCausalMM, builder: SequenceBuilder) -> None:
        self.model, self.builder = model, builder
        self.config_hash = model.config.config_hash()

    @torch.no_grad()
    def __call__(self, req: DiTRequest) -> DiTOutput:
        from diffusers import FlowMatchEulerDiscreteScheduler

        ar = req.ar
        seq = self.builder.dit_sequence(ar.user_text, ar.cond_images, ar.assistant_ids, ar.system_prompt,
                                        ar.ratio_index)
        cfg_on = req.guidance_scale > 1.0
        timings: dict = {}

        t0 = time.perf_counter()
        kv_path, reason, cache = "recompute", req.absent_reason or "no KV given", None
        if req.prompt_kv is not None:
            problem = self.check_kv(req.prompt_kv, seq)
            if problem:
                reason = problem
            else:
                cache = self.prefix_from_reuse(seq, req.prompt_kv, req.images, cfg_on)
                kv_path, reason = "reuse", ""
        if cache is None:
            cache = self.prefix_from_scratch(seq, req.images, cfg_on)
        timings["dit_prefix_s"] = time.perf_counter() - t0

        gen = seq.gen_image
        latent_channels = self.model.config.vae.latent_channels
        noise_gen = torch.Generator().manual_seed(request_seed(req.seed, ar.id))
        latents = torch.randn(1, latent_channels, gen.h, gen.w, generator=noise_gen).to(self.model.device)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=req.flow_shift)
        scheduler.set_timesteps(req.steps, device=self.model.device)
        step = self.step_inputs(seq, cache.k[0].shape[0])
        step_times = []
        for t in scheduler.timesteps:
            ts = time.perf_counter()
            velocity = self.predict(cache, seq, latents, t.reshape(1).float(), req.guidance_scale, step)
            latents = scheduler.step(velocity, t, latents).prev_sample
            step_times.append(time.perf_counter() - ts)
        timings["dit_step_s"] = step_times

        t1 = time.perf_counter()
        timings["dit_total_s"] = t1 - t0  # prefix + denoising; the VAE decode is timed apart
        image = self.decode(latents)
        timings["vae_decode_s"] = time.perf_counter() - t1
        return DiTOutput(ar.id, image, latents.float().cpu(), kv_path, reason, timings)

    # -- prefix K/V -------------------------------------------------------------------------------
    def check_kv(self, kv: PromptKV, seq: Sequence) -> str:
        """Why this KV cannot be reused for `seq` ("" when it can)."""
        cfg = self.model.config
        if seq.pos_reuse_len == 0:
            return "no reuse boundary (no CoT end tag or <answer>)"
        if kv.config_hash and kv.config_hash != self.config_hash:
            return f"config hash {kv.config_hash} != model {self.config_hash}"
        if kv.num_layers != cfg.num_hidden_layers:
            return f"KV has {kv.num_layers} layers, model has {cfg.num_hidden_layers}"
        if tuple(kv.keys[0].shape[1:]) != (cfg.num_key_value_heads, cfg.attention_head_dim):
            return f"KV head shape {tuple(kv.keys[0].shape[1:])} does not match the model"
        if (kv.pos_reuse_len, kv.neg_reuse_len) != (seq.pos_reuse_len, seq.neg_reuse_len):
            return (f"reuse boundaries ({kv.pos_reuse_len}, {kv.neg_reuse_len}) != sequence "
                    f"({seq.pos_reuse_len}, {seq.neg_reuse_len})")
        expected = seq.cond_ids[:seq.pos_reuse_len]
        if kv.token_ids != expected:
            i = first_difference(kv.token_ids, expected)
            return f"prefix tokens differ from the DiT sequence at index {i}"
        short = [i for i, (k, v) in enumerate(zip(kv.keys, kv.values))
                 if k.shape[0] != seq.pos_reuse_len or v.shape[0] != seq.pos_reuse_len]
        if short:
            return f"layer {short[0]}: KV holds {kv.keys[short[0]].shape[0]} tokens, expected {seq.pos_reuse_len}"
        return ""

    def prefix_from_scratch(self, seq: Sequence, images: list[Image.Image], cfg_on: bool) -> KVCache:
        """Denoise step 1 of the recompute path: the prefix of both rows from token 0."""
        cond = self._encode(seq, images, 0)
        rows = [seq.cond_ids] + ([seq.uncond_ids] if cfg_on else [])
        cache = self.model.new_cache(len(rows), self._capacity(seq))
        self._prefill(cache, seq, rows, 0, cond)
        return cache

    def prefix_from_reuse(self, seq: Sequence, kv: PromptKV, images: list[Image.Image], cfg_on: bool) -> KVCache:
        """Inject AR K/V and compute only what the AR did not: the cond row after the boundary,
        and the uncond row from its first `<cfg>` on top of the shared prefix."""
        pos, neg = seq.pos_reuse_len, seq.neg_reuse_len
        cond = self._encode(seq, images, min(pos, neg) if cfg_on else pos)
        rows = []
        for ids, shared in [(seq.cond_ids, pos)] + ([(seq.uncond_ids, neg)] if cfg_on else []):
            cache = self.model.new_cache(1, seq.gen_image.timestep_index)
            self._inject(cache, kv, shared)
            self._prefill(cache, seq, [ids], shared, cond)
            rows.append(cache)
        return KVCache.from_rows(rows, extra_capacity=1 + seq.gen_image.h * seq.gen_image.w)

    def _inject(self, cache: KVCache, kv: PromptKV, n: int) -> None:
        dev, dtype = self.model.device, self.model.dtype
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            cache.k[layer][0, :, :n] = k[:n].transpose(0, 1).to(dev, dtype)
            cache.v[layer][0, :, :n] = v[:n].transpose(0, 1).to(dev, dtype)
        cache.length = n

    def _prefill(self, cache: KVCache, seq: Sequence, rows: list[list[int]], start: int,
                 cond: list[EncodedImage]) -> None:
        """Run tokens [start, <timestep>) of each row on top of the cache's first `start` slots."""
        end = seq.gen_image.timestep_index
        if end <= start:
            return
        model = self.model
        x = torch.stack([embed_span(model, ids, seq, start, end, cond) for ids in rows])
        positions = seq.positions()[start:end].expand(len(rows), -1, -1)
        blocks = seq.block_ids()
        q = torch.arange(start, end).expand(len(rows), -1)
        k = torch.arange(end).expand(len(rows), -1)
        mask = attention_mask(q, k, blocks[start:end].expand(len(rows), -1), blocks[:end].expand(len(rows), -1))
        model.forward_layers(x, positions.to(model.device), mask.to(model.device), cache)
        cache.commit()

    def _encode(self, seq: Sequence, images: list[Image.Image], start: int) -> list[EncodedImage]:
        """Encode conditioning images only if some image block lies in the span we compute."""
        if not any(slot.end > start for slot in seq.cond_images):
            return []
        if len(images) != len(seq.cond_images):
            raise ValueError(f"sequence has {len(seq.cond_images)} conditioning images, got {len(images)}")
        return encode_cond_images(self.model, self.builder, images)

    @staticmethod
    def _capacity(seq: Sequence) -> int:
        return seq.gen_image.timestep_index + 1 + seq.gen_image.h * seq.gen_image.w

    # -- denoising --------------------------------------------------------------------------------
    def step_inputs(self, seq: Sequence, batch: int) -> tuple[torch.Tensor, HeadMask]:
        """RoPE positions and mask of `<timestep>` + image tokens: the same at every step, built once."""
        device, start, end = self.model.device, seq.gen_image.timestep_index, seq.gen_image.end
        positions = seq.positions()[start:end].expand(batch, -1, -1).to(device)
        # <timestep> sees the prefix and itself; the image block (last in the sequence) sees all.
        timestep_row = torch.arange(end) <= start
        return positions, HeadMask(timestep_row.view(1, 1, 1, end).expand(batch, 1, 1, end).to(device), rows=1)

    def predict(self, cache: KVCache, seq: Sequence, latents: torch.Tensor, t: torch.Tensor,
                guidance: float, step: tuple[torch.Tensor, HeadMask] | None = None) -> torch.Tensor:
        """Velocity for `latents` at time t: `<timestep>` + image tokens over the cached prefix."""
        model, gen = self.model, seq.gen_image
        batch = cache.k[0].shape[0]
        positions, mask = step or self.step_inputs(seq, batch)
        t = t.to(model.device)
        x = torch.cat([model.timestep_tokens(t), model.image_tokens(latents, t)[0]]).unsqueeze(0)
        hidden = model.forward_layers(x.expand(batch, -1, -1), positions, mask, cache)
        out = model.image_output(hidden[:, 1:], t.expand(batch), gen.h, gen.w).float()
        if batch == 1:
            return out
        cond, uncond = out[0:1], out[1:2]
        return uncond + guidance * (cond - uncond)

    def decode(self, latents: torch.Tensor) -> Image.Image:
        from .image_processing import tensor_to_pil

        vae = self.model.vae
        pixels = vae.decode(latents.to(next(vae.parameters()).dtype))
        return tensor_to_pil(pixels[0].float().cpu())
