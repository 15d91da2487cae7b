"""DiT stage: flow-matching Euler denoising with CFG, from recomputed or reused prompt K/V.

    prefix K/V  = recompute: the whole prefix [cond; uncond] in one forward (denoise step 1)
                  reuse:     AR K/V[:pos] + prefill of the cond row's rest, and
                             AR K/V[:neg] + prefill of the uncond row from its first <cfg>
    latents = bf16 noise from the request's generator (official `prepare_latents`)
    for t in timesteps:      only <timestep> (+ <guidance>, <timestep_r>) + image tokens are
                             computed, over the cached prefix
        v = uncond + g * (cond - uncond)        (optionally rescaled; Distil: one row, g as a token)
        latents = scheduler.step(v, t, latents)
    image = vae.decode(latents)

The schedule is the official one (`FlowMatchDiscreteScheduler(shift, reverse=True)`): N + 1 sigmas
linearly from 1 to 0, shifted by s*sigma / (1 + (s - 1) * sigma), timesteps = sigma[:-1] * 1000;
diffusers' FlowMatchEulerDiscreteScheduler runs it given those sigmas explicitly.

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

from . import kernels
from .ar import AROutput, request_seed
from .inputs import EncodedImage, embed_span, encode_cond_images, request_generator, skip_cond_draws
from .kvcache import PromptKV
from .sequence import Sequence, SequenceBuilder, first_difference
from .step_cache import FirstBlockCache
from .transformer import HeadMask, HunyuanImage3ForCausalMM, KVCache, SlotMask, attention_mask


@dataclass
class DiTRequest:
    ar: AROutput
    images: list[Image.Image] = field(default_factory=list)  # the same conditioning images the AR saw
    prompt_kv: PromptKV | None = None
    absent_reason: str = ""  # why prompt_kv is None, when the KV store had none
    steps: int | None = None  # None: the model's generation config (diff_infer_steps)
    guidance_scale: float | None = None  # None: diff_guidance_scale
    flow_shift: float | None = None  # None: flow_shift
    guidance_rescale: float = 0.0  # official pipeline default
    seed: int | None = None  # None: the AR row's seed (then the K/V's conditioning latents match)
    step_cache: float = 0.0  # > 0: first-block step cache threshold (approximate; step_cache.py)


@dataclass
class DiTOutput:
    id: str
    image: Image.Image | None  # None on a pipeline stage that leaves this row's image to another
    latents: torch.Tensor
    kv_path: str  # "reuse" | "recompute"
    kv_reason: str  # why recompute ("" on reuse)
    timings: dict = field(default_factory=dict)


@dataclass
class DenoisingRow:
    """One request between `DiTGenerator.prepare` and `finish`: its prefix K/V, latents and
    scheduler (a pipeline schedule keeps several of them in flight)."""

    req: DiTRequest
    seq: Sequence
    steps: int
    guidance: float
    cache: KVCache
    kv_path: str
    reason: str
    timings: dict
    t0: float
    latents: torch.Tensor
    scheduler: object
    step: tuple  # (positions, HeadMask) of the step's tokens
    step_cache: FirstBlockCache | None = None
    meanflow: bool = False

    def t(self, i: int) -> torch.Tensor:
        return self.scheduler.timesteps[i].reshape(1).float()

    def t_r(self, i: int) -> torch.Tensor | None:
        """Distil's next timestep (official get_timestep_r), None for other models."""
        return self.scheduler.sigmas[i + 1].reshape(1) * 1000 if self.meanflow else None


# When a model has no generation config (should not happen for checkpoints): the released values.
FALLBACK_STEPS, FALLBACK_GUIDANCE, FALLBACK_SHIFT = 50, 5.0, 3.0


def official_scheduler(steps: int, shift: float, device: torch.device | str = "cpu"):
    """diffusers' FlowMatchEulerDiscreteScheduler on the official schedule: sigmas
    linspace(1, 0, steps + 1) shifted by `shift` (diffusers applies the shift and appends the 0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    sigmas = torch.linspace(1, 0, steps + 1)[:-1]
    scheduler.set_timesteps(sigmas=sigmas.tolist(), device=device)
    return scheduler


def rescale_noise_cfg(pred: torch.Tensor, pred_cond: torch.Tensor, guidance_rescale: float) -> torch.Tensor:
    """CFG rescale (Lin et al. 2023, sec. 3.4), as the official pipeline applies it."""
    dims = list(range(1, pred.ndim))
    rescaled = pred * (pred_cond.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True))
    return guidance_rescale * rescaled + (1 - guidance_rescale) * pred


class DiTGenerator:
    def __init__(self, model: HunyuanImage3ForCausalMM, builder: SequenceBuilder, generation_config=None) -> None:
        self.model, self.builder = model, builder
        self.generation_config = generation_config
        self.config_hash = model.kv_hash()

    @staticmethod
    def seed(req: DiTRequest) -> int:
        if req.seed is not None:
            return req.seed
        return req.ar.seed if req.ar.seed is not None else request_seed(None, req.ar.id)

    def settings(self, req: DiTRequest) -> tuple[int, float, float]:
        """(steps, guidance, flow_shift): the request's, else the generation config's."""
        gc = self.generation_config
        steps = req.steps if req.steps is not None else getattr(gc, "diff_infer_steps", FALLBACK_STEPS)
        guidance = (req.guidance_scale if req.guidance_scale is not None
                    else getattr(gc, "diff_guidance_scale", FALLBACK_GUIDANCE))
        shift = req.flow_shift if req.flow_shift is not None else getattr(gc, "flow_shift", FALLBACK_SHIFT)
        return int(steps), float(guidance), float(shift)

    @torch.no_grad()
    def __call__(self, req: DiTRequest) -> DiTOutput:
        with self.model.autocast():
            row = self.prepare(req)
            for i in range(row.steps):
                ts = time.perf_counter()
                velocity = self.predict(row.cache, row.seq, row.latents, row.t(i), row.guidance, row.step,
                                        row.t_r(i), req.guidance_rescale, row.step_cache)
                row.latents = row.scheduler.step(velocity, row.scheduler.timesteps[i], row.latents).prev_sample
                row.timings["dit_step_s"].append(time.perf_counter() - ts)
            return self.finish(row)

    def kv_decision(self, req: DiTRequest) -> tuple[Sequence, str]:
        """The row's DiT sequence, and why its K/V cannot be reused ("" when it can), agreed by
        every rank of the model copy (one collective, so their later collectives match)."""
        ar = req.ar
        if ar.is_text_only:
            raise ValueError(f"request {ar.id}: a text answer (bot_task auto) has no image to denoise")
        seq = ar.dit_sequence(self.builder)
        problem = req.absent_reason or "no KV given"
        if req.prompt_kv is not None:
            problem = self.check_kv(req.prompt_kv, seq)
            seed = self.seed(req)
            if not problem and seq.cond_images and ar.seed is not None and seed != ar.seed:
                # the K/V holds conditioning latents drawn from the AR's stream; a recompute draws them
                # from this request's stream (official DiT pass)
                problem = f"seed {seed} differs from the AR's {ar.seed}, which drew the conditioning latents"
        parallel = getattr(self.model, "parallel", None)
        if parallel is not None and (parallel.world_size > 1 or parallel.pp_size > 1) \
                and not parallel.all_true(not problem):
            problem = problem or "another tensor-parallel rank or pipeline stage could not use its KV part"
        return seq, problem

    def prepare(self, req: DiTRequest, decision: tuple[Sequence, str] | None = None,
                stage_sends: list | None = None) -> "DenoisingRow":
        """Everything before the first denoising step: settings, the prefix K/V (reused or
        recomputed), the initial noise, the scheduler and the step's positions and mask.
        `decision`: the row's `kv_decision`, if taken already. `stage_sends` (pipeline stages): the
        prefix forwards do not wait for the later stages; their hand-offs are added to this list
        for the caller to wait on, so stage 0 goes on to the next row's prefix meanwhile."""
        seq, problem = decision or self.kv_decision(req)
        steps, guidance, shift = self.settings(req)
        distilled = self.model.config.cfg_distilled
        cfg_on = guidance > 1.0 and not distilled  # Distil takes the scale as a token, one row
        timings: dict = {"dit_steps": steps, "dit_step_s": []}

        t0 = time.perf_counter()
        # one stream per request, as the official DiT pass: conditioning-image posterior draws, then noise
        generator = request_generator(self.model, self.seed(req))
        if req.prompt_kv is not None and not problem:
            cache = self.prefix_from_reuse(seq, req.prompt_kv, req.images, cfg_on, generator,
                                           stage_sends=stage_sends)
            kv_path, reason = "reuse", ""
        else:
            cache = self.prefix_from_scratch(seq, req.images, cfg_on, generator, stage_sends=stage_sends)
            kv_path, reason = "recompute", problem
        timings["dit_prefix_s"] = time.perf_counter() - t0

        if req.step_cache > 0 and self.model.pipeline is not None:
            raise ValueError("the step cache does not run across pipeline stages (--step-cache with --pp > 1)")
        return DenoisingRow(req, seq, steps, guidance, cache, kv_path, reason, timings, t0,
                            latents=self.initial_noise(seq, generator),
                            scheduler=official_scheduler(steps, shift, self.model.device),
                            step=self.step_inputs(seq, cache.k[0].shape[0]),
                            step_cache=FirstBlockCache(req.step_cache) if req.step_cache > 0 else None,
                            meanflow=self.model.config.use_meanflow)

    def finish(self, row: "DenoisingRow", pixels: torch.Tensor | None = None,
               want_image: bool = True) -> DiTOutput:
        """The denoised latents -> the image (VAE decode, unless `pixels` come decoded from another
        pipeline stage; official output size alignment). `want_image=False`: no image (a pipeline
        stage that neither decodes nor writes this row)."""
        ar, timings = row.req.ar, row.timings
        if row.step_cache is not None:
            timings["dit_steps_skipped"] = row.step_cache.skipped
        t1 = time.perf_counter()
        timings["dit_total_s"] = t1 - row.t0  # prefix + denoising; the VAE decode is timed apart
        image = None
        if want_image:
            image = self.decode(row.latents) if pixels is None else self.to_image(pixels)
        if image is not None and ar.infer_align_image_size:  # official postprocess_outputs: match a cond image's ratio
            from .image_processing import align_output_size

            image = align_output_size(image, ar.ratio_index,
                                      [(c.ratio_index, c.orig_width, c.orig_height) for c in ar.cond_images],
                                      self.builder.resolutions)
        timings["vae_decode_s"] = time.perf_counter() - t1
        return DiTOutput(ar.id, image, row.latents.float().cpu(), row.kv_path, row.reason, timings)

    # -- prefix K/V -------------------------------------------------------------------------------
    def check_kv(self, kv: PromptKV, seq: Sequence) -> str:
        """Why this KV cannot be reused for `seq` ("" when it can)."""
        cfg = self.model.config
        if seq.pos_reuse_len == 0:
            return "no reuse boundary (no CoT end tag or <answer>)"
        if kv.config_hash and kv.config_hash != self.config_hash:
            return f"config hash {kv.config_hash} != model {self.config_hash}"
        layers = len(self.model.stage_layers)  # a pipeline stage's KV holds its own layers
        if kv.num_layers != layers:
            return f"KV has {kv.num_layers} layers, model{' stage' if layers != cfg.num_hidden_layers else ''} has {layers}"
        attn = self.model.first_attention()  # this rank's heads under tensor parallelism
        if tuple(kv.keys[0].shape[1:]) != (attn.num_kv_heads, attn.head_dim):
            return (f"KV head shape {tuple(kv.keys[0].shape[1:])} does not match the model's "
                    f"{(attn.num_kv_heads, attn.head_dim)}")
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

    def _cfg_split(self, cfg_on: bool) -> bool:
        """Whether this rank's group computes one CFG row and trades predictions with the other group."""
        parallel = getattr(self.model, "parallel", None)
        return cfg_on and parallel is not None and parallel.cfg_parallel

    def _rows(self, seq: Sequence, cfg_on: bool) -> list[tuple[list[int], int]]:
        """(ids, reusable prefix length) of the CFG rows this rank computes: [cond; uncond], or the
        one row of its group under CFG parallelism, or cond alone without CFG."""
        cond, uncond = (seq.cond_ids, seq.pos_reuse_len), (seq.uncond_ids, seq.neg_reuse_len)
        if not cfg_on:
            return [cond]
        if self._cfg_split(cfg_on):
            return [cond] if self.model.parallel.cfg_rank == 0 else [uncond]
        return [cond, uncond]

    def prefix_from_scratch(self, seq: Sequence, images: list[Image.Image], cfg_on: bool,
                            generator: torch.Generator | None = None, stage_sends: list | None = None) -> KVCache:
        """Denoise step 1 of the recompute path: the prefix of both rows from token 0."""
        cond = self._encode(seq, images, 0, generator)
        rows = [ids for ids, _ in self._rows(seq, cfg_on)]
        cache = self.model.new_cache(len(rows), self._capacity(seq))
        self._prefill(cache, seq, rows, 0, cond, stage_sends)
        return cache

    def prefix_from_reuse(self, seq: Sequence, kv: PromptKV, images: list[Image.Image], cfg_on: bool,
                          generator: torch.Generator | None = None, stage_sends: list | None = None) -> KVCache:
        """Inject AR K/V and compute only what the AR did not: the cond row after the boundary,
        and the uncond row from its first `<cfg>` on top of the shared prefix."""
        row_specs = self._rows(seq, cfg_on)
        cond = self._encode(seq, images, min(shared for _, shared in row_specs), generator)
        rows = []
        for ids, shared in row_specs:
            cache = self.model.new_cache(1, seq.gen_image.timestep_index)
            self._inject(cache, kv, shared)
            self._prefill(cache, seq, [ids], shared, cond, stage_sends)
            rows.append(cache)
        return KVCache.from_rows(rows, extra_capacity=seq.gen_image.end - seq.gen_image.timestep_index)

    def _inject(self, cache: KVCache, kv: PromptKV, n: int) -> None:
        dev, dtype = self.model.device, self.model.dtype
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            cache.k[layer][0, :, :n] = k[:n].transpose(0, 1).to(dev, dtype)
            cache.v[layer][0, :, :n] = v[:n].transpose(0, 1).to(dev, dtype)
        cache.length = n

    def _prefill(self, cache: KVCache, seq: Sequence, rows: list[list[int]], start: int,
                 cond: list[EncodedImage], stage_sends: list | None = None) -> None:
        """Run tokens [start, <timestep>) of each row on top of the cache's first `start` slots.
        `stage_sends` (pipeline stages): hand this stage's output on without waiting for the later
        stages (only the K/V they write is needed), adding the hand-off to the list."""
        end = seq.gen_image.timestep_index
        if end <= start:
            return
        model = self.model
        x = None if self._later_stage() else torch.stack([embed_span(model, ids, seq, start, end, cond)
                                                          for ids in rows])
        positions = seq.positions()[start:end].expand(len(rows), -1, -1)
        blocks = seq.block_ids()
        q = torch.arange(start, end).expand(len(rows), -1)
        k = torch.arange(end).expand(len(rows), -1)
        mask = SlotMask(q, k, blocks[start:end].expand(len(rows), -1), blocks[:end].expand(len(rows), -1))
        positions, mask = positions.to(model.device), mask.to(model.device)
        compiled = kernels.prefill_compiled()
        if stage_sends is not None and model.pipeline is not None:
            work = model.stages.start(x, lambda h: model.forward_layers(h, positions, mask, cache, compiled=compiled,
                                                                        layers=model.stage_layers, prefill=True),
                                      back=False)
            stage_sends.extend(work.sends)
        else:
            model.forward_layers(x, positions, mask, cache, compiled=compiled, prefill=True)
        cache.commit()

    def _encode(self, seq: Sequence, images: list[Image.Image], start: int,
                generator: torch.Generator | None = None) -> list[EncodedImage]:
        """Encode conditioning images only if some image block lies in the span we compute and this
        process embeds it (a later pipeline stage receives hidden states); else advance the
        request's stream past the draws the encoding would take."""
        if generator is None:
            generator = request_generator(self.model, 0)
        needed = any(slot.end > start for slot in seq.cond_images)
        if needed and len(images) != len(seq.cond_images):  # on every stage alike
            raise ValueError(f"sequence has {len(seq.cond_images)} conditioning images, got {len(images)}")
        if not needed or self._later_stage():
            skip_cond_draws(self.model, [(slot.h, slot.w) for slot in seq.cond_images], generator)
            return []
        return encode_cond_images(self.model, self.builder, images, seq.infer_align_image_size, generator)

    def _later_stage(self) -> bool:
        """A pipeline stage after the first: it receives hidden states, so it embeds no tokens."""
        pp = self.model.pipeline
        return pp is not None and pp.pp_rank > 0

    @staticmethod
    def _capacity(seq: Sequence) -> int:
        return seq.gen_image.end  # prefix + <timestep> (+ <guidance>, <timestep_r>) + image tokens

    # -- denoising --------------------------------------------------------------------------------
    def initial_noise(self, seq: Sequence, generator: torch.Generator) -> torch.Tensor:
        """The official `prepare_latents`: diffusers' randn_tensor in bfloat16 from the request's
        generator (on the model's device); the scheduler upcasts to float32 from the first step on."""
        from diffusers.utils.torch_utils import randn_tensor

        gen, device = seq.gen_image, self.model.device
        shape = (1, self.model.config.vae.latent_channels, gen.h, gen.w)
        return randn_tensor(shape, generator=generator, device=device, dtype=torch.bfloat16).float()

    def step_inputs(self, seq: Sequence, batch: int) -> tuple[torch.Tensor, HeadMask]:
        """RoPE positions and mask of `<timestep>` (+ Distil's `<guidance>`, `<timestep_r>`) + image
        tokens: the same at every step, built once. The special tokens are causal; the image block
        (last in the sequence) sees every key."""
        device, gen = self.model.device, seq.gen_image
        start, end = gen.timestep_index, gen.end
        positions = seq.positions()[start:end].expand(batch, -1, -1).to(device)
        blocks = seq.block_ids()[:end]
        rows = gen.start - start
        q = torch.arange(start, gen.start).expand(batch, -1)
        k = torch.arange(end).expand(batch, -1)
        mask = attention_mask(q, k, blocks[start:gen.start].expand(batch, -1), blocks.expand(batch, -1))
        return positions, HeadMask(mask.to(device), rows=rows)

    def predict(self, cache: KVCache, seq: Sequence, latents: torch.Tensor, t: torch.Tensor,
                guidance: float, step: tuple[torch.Tensor, HeadMask] | None = None,
                t_r: torch.Tensor | None = None, guidance_rescale: float = 0.0,
                step_cache: FirstBlockCache | None = None) -> torch.Tensor:
        """Velocity for `latents` at time t: the step's special tokens + image tokens over the cached
        prefix, then classifier-free guidance over the [cond; uncond] rows."""
        model = self.model
        batch = cache.k[0].shape[0]
        positions, mask = step or self.step_inputs(seq, batch)
        x = self.step_tokens(latents, t, guidance, t_r, batch)
        compiled = kernels.enabled("compile", x, "on")
        hidden = (step_cache.forward(model, x, positions, mask, cache, compiled=compiled) if step_cache is not None
                  else model.forward_layers(x, positions, mask, cache, compiled=compiled))
        return self.guided(hidden, seq, t, guidance, guidance_rescale)

    def step_tokens(self, latents: torch.Tensor, t: torch.Tensor, guidance: float, t_r: torch.Tensor | None,
                    batch: int) -> torch.Tensor:
        """A denoising step's input [batch, T, H]: `<timestep>` (+ Distil's `<guidance>`,
        `<timestep_r>`) and the image tokens of `latents`, the same for every CFG row."""
        model = self.model
        t = t.to(model.device)
        tokens = [model.timestep_tokens(t)]
        if model.config.cfg_distilled:  # official: torch.tensor([1000 * g], dtype=bfloat16)
            g = torch.tensor([1000.0 * guidance], dtype=torch.bfloat16, device=model.device).float()
            tokens.append(model.guidance_tokens(g))
        if model.config.use_meanflow:
            tokens.append(model.timestep_r_tokens(t_r.to(model.device)))
        tokens.append(model.image_tokens(latents, t)[0])
        return torch.cat(tokens).unsqueeze(0).expand(batch, -1, -1)

    def guided(self, hidden: torch.Tensor, seq: Sequence, t: torch.Tensor, guidance: float,
               guidance_rescale: float = 0.0) -> torch.Tensor:
        """The last layer's hidden states -> the velocity: the image head, then classifier-free
        guidance over the [cond; uncond] rows."""
        model, gen = self.model, seq.gen_image
        batch = hidden.shape[0]
        special = gen.start - gen.timestep_index  # <timestep> (+ <guidance>, <timestep_r>) before the image
        out = model.image_output(hidden[:, special:], t.to(model.device).expand(batch), gen.h, gen.w).float()
        if batch == 1 and self._cfg_split(guidance > 1.0 and not model.config.cfg_distilled):
            out = model.parallel.gather_cfg(out)  # CFG parallel: the other group computed the other row
        elif batch == 1:
            return out
        cond, uncond = out[0:1], out[1:2]
        pred = uncond + guidance * (cond - uncond)
        if guidance_rescale > 0:
            pred = rescale_noise_cfg(pred, cond, guidance_rescale)
        return pred

    def decode(self, latents: torch.Tensor) -> Image.Image:
        return self.to_image(self.model.vae.decode(latents))

    @staticmethod
    def to_image(pixels: torch.Tensor) -> Image.Image:
        """The VAE's output [1, 3, H, W] -> the RGB image."""
        from .image_processing import tensor_to_pil

        return tensor_to_pil(pixels[0].float().cpu())
