"""Train the demo checkpoint: the HunyuanImage-3 architecture at a small size, on procedural scenes.

One command (on one GPU about 9 minutes; the CPU runs it too, slowly):

    python -m components.demo.train --out components/engine/assets/demo

1. data: `--examples` scenes drawn with `random.Random(f"demo-train-{i}")` (never the seeds of
   `ardit sample-data`, whose scenes are held out): a share of them edits (source image, one of the
   sample instructions, the exact edited target, components/data/sample.py), the rest captions
   (caption -> that scene). Each becomes the engine's own DiT sequence (SequenceBuilder: system
   prompt, conditioning image block with VAE and ViT tokens, instruction, the CoT text the model is
   taught to write, ratio token, generated image block).
2. VAE: the engine's encoder / decoder trained as an autoencoder (L1 + MSE + a small KL) on the
   scenes; `shift_factor` / `scaling_factor` then set from the latents' mean and std.
3. transformer (with ViT, aligner, patch embed and image head): one forward over the whole
   sequence, cross-entropy on the assistant's text (CoT, tags, ratio token) and the flow-matching
   velocity MSE on the generated image's tokens (x_t = (1 - s) x0 + s noise, target noise - x0,
   s on the inference schedule's shift); a share of rows takes the unconditional row (`<cfg>` for
   the user text and CoT), so classifier-free guidance has a learned uncond. A step never waits
   for the GPU (until a log line every 200 steps): indices and flow times are drawn on the host
   and copied from pinned memory without a sync, the token tensors live on the device, and the
   experts run densely (`--moe dense`; `--moe loop` is the engine's per-expert loop, whose
   `nonzero` syncs once per expert and layer). `--resume DIR` goes on from a checkpoint with its
   VAE and its tokenizer (token ids must stay those its embeddings learned).
4. the checkpoint in the official layout (config.json, sharded safetensors in float16,
   generation_config.json, tokenizer, system_prompt.py) plus train_meta.json (seeds,
   hyper-parameters, steps, losses, the command).

Everything runs through the engine's modules (transformer.py, vae.py, vit.py, sequence.py,
weights.py), so `Engine.load("demo")` reads the result with the normal loader. Gradients need a
path the engine's inference code does not take (it runs under no_grad): the whole-sequence forward
below calls the same modules in the same order as `inputs.embed_span` and `dit.DiTGenerator`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from components.data import sample
from components.demo import spec

STARTED = time.time()
VAE_RENDER = 256  # scenes are drawn at 256 (as `ardit sample-data`) and fitted to 128 as the engine does


@dataclass
class Settings:
    out: str
    seed: int = 0
    examples: int = 40000
    edit_share: float = 0.6
    workers: int = 0  # 0: all CPUs
    device: str = "cuda"
    vae_steps: int = 0  # 0: as many as --vae-minutes allow
    vae_minutes: float = 2.5
    vae_batch: int = 64
    vae_lr: float = 5e-4
    vae_kl: float = 1e-4
    dit_steps: int = 0
    dit_minutes: float = 5.0
    dit_batch: int = 96
    dit_lr: float = 4e-4
    warmup: int = 200
    uncond_share: float = 0.12
    text_weight: float = 0.2
    ema: float = 0.999
    flow_shift: float = 3.0
    resume: str = ""  # a checkpoint directory: keep its VAE and go on training its transformer
    caption_places: int = 1  # captions name the sun's or moon's rough place (sample.CAPTION_PLACES); 0: the older wording
    amp: int = 1  # bfloat16 autocast
    total_minutes: float = 0.0  # > 0: the transformer stops early so that the whole run ends in time
    moe: str = "dense"  # training's expert path: dense (every expert on every token, weighted by the
    # routing, no host syncs) | loop (the engine's per-expert loop, a `nonzero` sync per expert)


# -- data -----------------------------------------------------------------------------------------
_builder = None


def _init_worker(tokenizer_file: str, caption_places: bool = False) -> None:
    global _builder
    sample.CAPTION_PLACES = caption_places  # this process's captions (and CoT recaptions)
    from tokenizers import Tokenizer as HFTokenizer

    from components.engine.sequence import SequenceBuilder
    from components.engine.tokenizer import Tokenizer

    torch.set_num_threads(1)
    _builder = SequenceBuilder(Tokenizer(HFTokenizer.from_file(tokenizer_file), source="demo"), spec.BASE_SIZE,
                               max_length=4096)


def system_prompt() -> str:
    from components.engine.system_prompts import resolve_system_prompt

    gc = spec.generation_config()
    return resolve_system_prompt(gc.use_system_prompt, gc.bot_task, spec.SYSTEM_PROMPTS)


def _fit(image, size: int = spec.BASE_SIZE) -> np.ndarray:
    from components.engine.image_processing import resize_and_crop

    return np.asarray(resize_and_crop(image, size, size, "center"), dtype=np.uint8)


def _vit_pixels(image) -> np.ndarray:
    """The image as the ViT processor resizes it (naflex to 8 x 8 patches: 128 x 128, bilinear)."""
    from components.engine.vit import resize_uint8_bilinear

    pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()
    return resize_uint8_bilinear(pixels, spec.BASE_SIZE, spec.BASE_SIZE).numpy()


def make_example(index: int, edit_share: float, seed: int, system: str) -> dict:
    from components.engine.sequence import CondImage

    rng = random.Random(f"demo-train-{seed}-{index}")
    builder = _builder
    ratio = builder.resolutions.ratio_index(spec.BASE_SIZE, spec.BASE_SIZE)
    if rng.random() < edit_share:
        kind = list(sample.KIND_INSTRUCTIONS)[rng.randrange(len(sample.KIND_INSTRUCTIONS))]
        source, target = sample.edit_example(rng, kind)
        text = sample.KIND_INSTRUCTIONS[kind]
        src_image = sample.render(source, VAE_RENDER)
        images = [CondImage(8, 8, ratio, (8, 8), 64, VAE_RENDER, VAE_RENDER)]
    else:
        kind, target = None, sample.random_caption_scene(rng)
        text, src_image, images = sample.caption(target), None, []
    think, recaption = sample.chain_of_thought(kind, target)
    cot = f"<think>{think}</think><recaption>{recaption}</recaption>"
    seq = builder.dit_sequence(text, images, cot, system, ratio)
    gen = seq.gen_image
    out = {
        "cond_ids": np.array(seq.cond_ids, dtype=np.int32),
        "uncond_ids": np.array(seq.uncond_ids, dtype=np.int32),
        "positions": seq.positions().numpy().astype(np.float32),
        "blocks": seq.block_ids().numpy().astype(np.int16),
        "gen_t": gen.timestep_index, "gen_start": gen.start,
        # CE targets: the assistant's tokens through the ratio token (predicted from the token before)
        "text_from": seq.assistant_start + 1, "text_to": gen.timestep_index - 1,
        "target": _fit(sample.render(target, VAE_RENDER)),
        "has_cond": src_image is not None,
        "cond_t": -1, "cond_start": -1, "vit_start": -1,
        "source": None, "vit": None,  # captions have no conditioning image
    }
    if src_image is not None:
        slot = seq.cond_images[0]
        out |= {"cond_t": slot.timestep_index, "cond_start": slot.start, "vit_start": slot.vit_start,
                "source": _fit(src_image), "vit": _vit_pixels(src_image)}
    return out


def build_dataset(settings: Settings, tokenizer_file: str) -> dict[str, torch.Tensor]:
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    system = system_prompt()
    work = partial(make_example, edit_share=settings.edit_share, seed=settings.seed, system=system)
    workers = settings.workers or os.cpu_count() or 1
    places = bool(settings.caption_places)
    if workers == 1:
        _init_worker(tokenizer_file, places)
        rows = [work(i) for i in range(settings.examples)]
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(tokenizer_file, places)) as pool:
            rows = list(pool.map(work, range(settings.examples), chunksize=64))
    n, length = len(rows), max(len(r["cond_ids"]) for r in rows)
    pad = 0
    data = {k: torch.full((n, length), pad, dtype=torch.long) for k in ("cond_ids", "uncond_ids")}
    data["blocks"] = torch.full((n, length), -1, dtype=torch.long)
    data["positions"] = torch.arange(length, dtype=torch.float32).view(1, length, 1).repeat(n, 1, 2)
    data["text_mask"] = torch.zeros((n, length), dtype=torch.bool)
    for i, r in enumerate(rows):
        m = len(r["cond_ids"])
        data["cond_ids"][i, :m] = torch.from_numpy(r["cond_ids"])
        data["uncond_ids"][i, :m] = torch.from_numpy(r["uncond_ids"])
        data["blocks"][i, :m] = torch.from_numpy(r["blocks"].astype(np.int64))
        data["positions"][i, :m] = torch.from_numpy(r["positions"])
        data["text_mask"][i, r["text_from"] - 1:r["text_to"]] = True  # position p predicts token p + 1
    for key in ("gen_t", "gen_start", "cond_t", "cond_start", "vit_start"):
        data[key] = torch.tensor([r[key] for r in rows], dtype=torch.long)
    data["length"] = torch.tensor([len(r["cond_ids"]) for r in rows], dtype=torch.long)
    data["has_cond"] = torch.tensor([r["has_cond"] for r in rows], dtype=torch.bool)
    data["target"] = torch.from_numpy(np.stack([r["target"] for r in rows])).permute(0, 3, 1, 2).contiguous()
    # the edits' conditioning images only (captions have none): row cond_index[i] of source / vit
    edits = [r for r in rows if r["has_cond"]]
    data["cond_index"] = torch.cumsum(data["has_cond"].long(), 0) - 1
    data["cond_index"][~data["has_cond"]] = -1
    empty = np.zeros((0, spec.BASE_SIZE, spec.BASE_SIZE, 3), np.uint8)
    data["source"] = torch.from_numpy(np.stack([r["source"] for r in edits]) if edits else empty).permute(0, 3, 1, 2).contiguous()
    data["vit"] = torch.from_numpy(np.stack([r["vit"] for r in edits]) if edits else empty.transpose(0, 3, 1, 2))
    return data


def autocast(settings: Settings):
    """bfloat16 autocast for the training forwards (`--amp`, on by default)."""
    return torch.autocast(settings.device.split(":")[0], dtype=torch.bfloat16, enabled=bool(settings.amp))


def to_unit(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float [-1, 1] (image_processing.pil_to_tensor)."""
    return (pixels.float() / 255.0 - 0.5) / 0.5


def vit_patches(pixels: torch.Tensor, patch: int = 16) -> torch.Tensor:
    """uint8 [B, 3, 128, 128] (already at the ViT's size) -> [B, 64, 768], as vit.preprocess_for_vit."""
    x = (pixels.float() - 127.5) / 127.5
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


# -- VAE ------------------------------------------------------------------------------------------
def vae_moments(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[-1, 1] pixels -> posterior mean, logvar [B, z, h, w] (AutoencoderKLConv3D.encode's math)."""
    moments = vae.encoder(pixels.unsqueeze(2).expand(-1, -1, vae.ffactor_temporal, -1, -1))
    mean, logvar = moments.chunk(2, dim=1)
    return mean[:, :, 0], logvar[:, :, 0].clamp(-30.0, 20.0)


def vae_decode(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decoder(z.unsqueeze(2))[:, :, -1]


def train_vae(vae, data, settings: Settings, log) -> dict:
    device = settings.device
    images = torch.cat([data["target"], data["source"]])
    opt = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    t0, step, losses = time.time(), 0, []
    budget = settings.vae_minutes * 60
    vae.train()
    while (step < settings.vae_steps) if settings.vae_steps else (time.time() - t0 < budget):
        idx = torch.randint(0, images.shape[0], (settings.vae_batch,), generator=gen)
        x = to_unit(images[idx]).to(device)
        lr = settings.vae_lr * min(1.0, (step + 1) / 100)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast(settings):
            mean, logvar = vae_moments(vae, x)
            z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
            rec = vae_decode(vae, z).float()
        kl = 0.5 * (mean.float() ** 2 + logvar.float().exp() - 1 - logvar.float()).mean()
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + settings.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 200 == 0:
            psnr = -10 * math.log10(F.mse_loss(rec.clamp(-1, 1), x).item() / 4 + 1e-12)
            log(f"vae step {step} loss {loss.item():.4f} kl {kl.item():.3f} psnr {psnr:.1f} dB "
                f"({time.time() - t0:.0f} s)")
        step += 1
    vae.eval()
    return {"vae_steps": step, "vae_final_loss": float(np.mean(losses[-50:])) if losses else None,
            "vae_seconds": round(time.time() - t0, 1)}


@torch.no_grad()
def encode_all(vae, pixels: torch.Tensor, device: str, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    if not pixels.shape[0]:  # no edits, so no conditioning images: empty latents of the right shape
        mean, _ = vae_moments(vae, torch.zeros((1, *pixels.shape[1:]), device=device))
        return mean[:0].float(), mean[:0].float()
    for i in range(0, pixels.shape[0], batch):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            mean, logvar = vae_moments(vae, to_unit(pixels[i:i + batch]).to(device))
        means.append(mean.float())
        stds.append(torch.exp(0.5 * logvar.float()))
    return torch.cat(means), torch.cat(stds)


# -- transformer ----------------------------------------------------------------------------------
def moe_loop_autocast(x, weights, experts, w_gate_up, w_down):
    """transformer.moe_loop's math (one GEMM pair per expert, then `_combine`), written so that
    autograd and mixed precision work: the engine's version fills a preallocated buffer in place,
    whose dtype must equal the GEMMs' (not so under autocast). Each expert's `nonzero` waits for
    the GPU (`--moe loop`)."""
    from components.engine.transformer import _combine, _swiglu

    n, k = experts.shape
    per_slot = torch.zeros(n, k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            y = _swiglu(x[token] @ w_gate_up[e].T) @ w_down[e].T
            per_slot = per_slot.index_put((token, slot), y.float())
    return _combine(per_slot, weights)


def moe_dense_autocast(x, weights, experts, w_gate_up, w_down):
    """The same routed output as `moe_loop_autocast` (sum over a token's k experts of weight x
    expert(x)), with every expert run on every token and weight 0 for the experts it was not
    routed to: twice the routed GEMMs of top-2 of 4 experts, but static shapes and no `nonzero`, so
    the host never waits for the GPU (`--moe dense`, the default). Weights and the sum in float32,
    as `_combine`."""
    from components.engine.transformer import _swiglu

    n = experts.shape[0]
    num, inter2, hidden = w_gate_up.shape
    gate = torch.zeros(n, num, dtype=torch.float32, device=x.device).scatter_add(1, experts, weights.float())
    h = (x @ w_gate_up.reshape(num * inter2, hidden).T).view(n, num, inter2)  # one GEMM for all experts
    y = torch.einsum("nei,ehi->neh", _swiglu(h), w_down)
    return (y.float() * gate.unsqueeze(-1)).sum(1)


class Staged:
    """Host tensors -> the device without waiting for it: pinned, then a non-blocking copy (a
    plain `.to(cuda)` of pageable memory synchronises the stream, once per tensor per step)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t.to(self.device)


_VIT_MASK = {"none": True}  # False once a transformers version refused pixel_attention_mask=None


def vit_forward(model, patches: torch.Tensor) -> torch.Tensor:
    """The ViT on [B, 64, 768] patches of 8 x 8 grids: without a padding mask (none is padded; a
    mask of ones makes transformers test `mask.all()`, a host sync) and with the spatial shapes made
    on the device."""
    b = patches.shape[0]
    spatial = torch.full((b, 2), 8, dtype=torch.long, device=patches.device)
    if _VIT_MASK["none"]:
        try:
            return model.vision_model(pixel_values=patches, pixel_attention_mask=None,
                                      spatial_shapes=spatial).last_hidden_state
        except (TypeError, AttributeError, ValueError):
            _VIT_MASK["none"] = False
    mask = torch.ones(patches.shape[:2], dtype=torch.long, device=patches.device)
    return model.vision_model(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=spatial).last_hidden_state


DEVICE_KEYS = ("cond_ids", "uncond_ids", "blocks", "positions", "vit")  # indexed on the device every step


def device_data(data: dict, device: str) -> dict:
    """The per-token tensors and the ViT pixels moved to the device once (the rest stays on the host,
    where the batch's index arithmetic runs without waiting for the GPU)."""
    return {k: data[k].to(device) for k in DEVICE_KEYS}


def sample_batch(data: dict, on_device: dict, latents: dict, idx: torch.Tensor, settings: Settings,
                 gen: torch.Generator, stage: Staged) -> dict:
    """One batch (rows `idx`, host indices): every index and random draw made on the host (the
    `--seed`'s generator), then copied without a sync; the device tensors indexed on the device."""
    b = idx.shape[0]
    length = int(data["length"][idx].max())
    idx_d = stage(idx)
    uncond = torch.rand(b, generator=gen) < settings.uncond_share
    has_cond = data["has_cond"][idx]
    cond = has_cond.nonzero(as_tuple=True)[0]  # host: batch rows with a conditioning image
    compact = data["cond_index"][idx[cond]]  # their rows in source / vit
    u = torch.rand(b, generator=gen)
    s = settings.flow_shift
    sigma = s * u / (1 + (s - 1) * u)
    text_mask = data["text_mask"][idx, :length] & ~uncond[:, None]
    tb, tp = text_mask.nonzero(as_tuple=True)  # host: the text positions the CE reads
    return {
        "b": b, "length": length, "n_cond": int(cond.numel()), "n_text": int(tb.numel()),
        "uncond": stage(uncond),
        "cond_ids": on_device["cond_ids"][idx_d, :length], "uncond_ids": on_device["uncond_ids"][idx_d, :length],
        "blocks": on_device["blocks"][idx_d, :length], "positions": on_device["positions"][idx_d, :length],
        "cond": cond, "cond_d": stage(cond), "compact_d": stage(compact),
        "cond_t": data["cond_t"][idx[cond]], "cond_start": data["cond_start"][idx[cond]],
        "vit_start": data["vit_start"][idx[cond]],
        "gen_t": data["gen_t"][idx], "gen_start": data["gen_start"][idx],
        "gen_pos": stage(data["gen_start"][idx][:, None] + torch.arange(64)),
        "sigma": stage(sigma), "tb": stage(tb), "tp": stage(tp),
        "idx_d": idx_d,
    }


def forward_batch(model, batch: dict, on_device: dict, latents: dict, settings: Settings, noise_gen):
    """(velocity MSE, text CE) of one batch (`sample_batch`): the engine's embeddings and layers
    over whole sequences. No step of it waits for the GPU (`--moe dense`)."""
    from components.engine.transformer import visible

    device = settings.device
    b, length = batch["b"], batch["length"]
    ids = torch.where(batch["uncond"][:, None], batch["uncond_ids"], batch["cond_ids"])
    x = model.embed_ids(ids)
    rows_b, rows_p, values = [], [], []

    def put(rows: torch.Tensor, starts: torch.Tensor, vals: torch.Tensor) -> None:  # host indices
        n = vals.shape[1]
        rows_b.append(rows.repeat_interleave(n))
        rows_p.append((starts[:, None] + torch.arange(n)).reshape(-1))
        values.append(vals.reshape(-1, vals.shape[-1]))

    if batch["n_cond"]:
        cond, compact = batch["cond"], batch["compact_d"]
        zero = torch.zeros(batch["n_cond"], device=device)
        put(cond, batch["cond_t"], model.timestep_tokens(zero)[:, None])
        mean, std = latents["source_mean"][compact], latents["source_std"][compact]
        eps = torch.randn(mean.shape, generator=noise_gen, device=device)
        z = (mean + std * eps - latents["shift"]) * latents["scale"]
        put(cond, batch["cond_start"], model.image_tokens(z, zero))
        patches = vit_patches(on_device["vit"][compact])
        put(cond, batch["vit_start"], model.vision_aligner(vit_forward(model, patches)))
    # the generated image: a point on the flow from the target latents to noise
    x0 = (latents["target_mean"][batch["idx_d"]] - latents["shift"]) * latents["scale"]
    sigma = batch["sigma"]
    noise = torch.randn(x0.shape, generator=noise_gen, device=device)
    xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    t = sigma * 1000
    all_rows = torch.arange(b)
    put(all_rows, batch["gen_t"], model.timestep_tokens(t)[:, None])
    put(all_rows, batch["gen_start"], model.image_tokens(xt, t))
    stage = Staged(device)
    bi, pi = stage(torch.cat(rows_b)), stage(torch.cat(rows_p))
    x = x.index_put((bi, pi), torch.cat(values).to(x.dtype))

    slots = torch.arange(length, device=device)
    blocks = batch["blocks"]
    mask = visible(slots.view(1, -1, 1), slots.view(1, 1, -1), blocks[:, :, None], blocks[:, None, :]).unsqueeze(1)
    hidden = model.forward_layers(x, batch["positions"], mask, None)

    image_hidden = hidden[torch.arange(b, device=device)[:, None], batch["gen_pos"]]
    pred = model.image_output(image_hidden, t, 8, 8).float()
    mse = F.mse_loss(pred, noise - x0)

    tb, tp = batch["tb"], batch["tp"]
    logits = model.text_logits(hidden[tb, tp])
    ce = F.cross_entropy(logits, ids[tb, tp + 1]) if batch["n_text"] else mse.new_zeros(())
    return mse, ce


def train_transformer(model, data, latents, settings: Settings, log) -> dict:
    device = settings.device
    cuda = device.startswith("cuda")
    named = [(name, p) for name, p in model.named_parameters() if not name.startswith("vae.")]
    params = [p for _, p in named]
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=settings.dit_lr, betas=(0.9, 0.98), **({"fused": True} if cuda else {}))
    ema = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(settings.seed + 2)  # batches, uncond rows, flow times (host)
    noise_gen = torch.Generator(device=device).manual_seed(settings.seed + 3)  # latent noise (device)
    stage = Staged(device)
    on_device = device_data(data, device)
    n = data["cond_ids"].shape[0]
    t0, step, history = time.time(), 0, []
    budget = settings.dit_minutes * 60
    if settings.total_minutes > 0:  # leave a minute for the EMA copy and the checkpoint
        budget = min(budget, settings.total_minutes * 60 - (t0 - STARTED) - 60)
    model.train()
    while True:
        elapsed = time.time() - t0
        if (step >= settings.dit_steps) if settings.dit_steps else (elapsed >= budget):
            break
        progress = step / settings.dit_steps if settings.dit_steps else elapsed / budget
        lr = settings.dit_lr * min(1.0, (step + 1) / settings.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, n, (settings.dit_batch,), generator=gen)
        batch = sample_batch(data, on_device, latents, idx, settings, gen, stage)
        with autocast(settings):
            mse, ce = forward_batch(model, batch, on_device, latents, settings, noise_gen)
        loss = mse + settings.text_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay_rate = min(settings.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay_rate)
        history.append(torch.stack([mse.detach(), ce.detach()]))  # read back every 200 steps only
        if step % 200 == 0:
            m, c = torch.stack(history[-200:]).float().mean(0).tolist()
            log(f"dit step {step} mse {m:.4f} ce {c:.4f} lr {lr:.2e} ({time.time() - t0:.0f} s, "
                f"{(step + 1) * settings.dit_batch / max(1e-9, time.time() - t0):.0f} samples/s)")
            history = history[-200:]
        step += 1
    with torch.no_grad():  # the EMA weights are the checkpoint's
        for p, e in zip(params, ema, strict=True):
            p.copy_(e)
    model.eval()
    tail = torch.stack(history[-200:]).float().mean(0).tolist() if history else (None, None)
    seconds = time.time() - t0
    return {"dit_steps": step, "dit_final_mse": tail[0], "dit_final_ce": tail[1],
            "dit_seconds": round(seconds, 1), "dit_samples_per_s": round(step * settings.dit_batch / max(seconds, 1e-9), 1)}


# -- the checkpoint -------------------------------------------------------------------------------
def save_checkpoint(model, config, tokenizer_backend, directory: Path, meta: dict) -> Path:
    from components.engine.generation_config import write_generation_config_file
    from components.engine.system_prompts import write_system_prompt_file
    from components.engine.tokenizer import write_tokenizer_files
    from components.engine.weights import save_pretrained

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("model-*.safetensors"):
        old.unlink()
    save_pretrained(model, config, directory, max_shard_bytes=12 << 20, dtype=torch.float16)
    write_tokenizer_files(directory, tokenizer_backend)
    write_system_prompt_file(directory, spec.SYSTEM_PROMPTS)
    write_generation_config_file(directory, spec.generation_config())
    (directory / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in Settings.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            parser.add_argument(flag, required=True, help="checkpoint directory to write")
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    settings = Settings(**vars(parser.parse_args(argv)))
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        settings.device = "cpu"
    out = Path(settings.out)
    started = STARTED
    if settings.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def log(msg: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {msg}", flush=True)

    from components.engine.transformer import HunyuanImage3ForCausalMM, MoE
    from components.engine.weights import load_pretrained

    torch.manual_seed(settings.seed)
    random.seed(settings.seed)
    os.environ.setdefault("ARDIT_KERNELS", "plain")
    import components.engine.transformer as transformer_module

    # the engine's loop path with training's expert function (autograd, autocast): moe_dense_autocast
    # (no host syncs) or moe_loop_autocast (the reference, a sync per expert)
    MoE.impl = "loop"
    transformer_module.moe_loop = {"dense": moe_dense_autocast, "loop": moe_loop_autocast}[settings.moe]
    # transformers' input checks on the ViT's spatial shapes read a GPU tensor back every step
    os.environ.setdefault("TRANSFORMERS_DISABLE_TORCH_CHECK", "1")
    config = spec.demo_config()
    sample.CAPTION_PLACES = bool(settings.caption_places)  # this process's captions too (the tokenizer corpus)
    if settings.resume:
        # the checkpoint's own tokenizer: its embeddings belong to those ids (a BPE rebuilt from
        # today's corpus would give other ids once the corpus's wording changed; byte-level BPE
        # encodes new words too)
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(Path(settings.resume) / "tokenizer.json"))
    else:
        backend = spec.build_tokenizer()
    if backend.get_vocab_size() > config.vocab_size:
        raise SystemExit(f"the tokenizer has {backend.get_vocab_size()} tokens, the config {config.vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = str(out / "tokenizer.json")
    backend.save(tokenizer_file)
    log(f"tokenizer: {backend.get_vocab_size()} tokens ({'from ' + settings.resume if settings.resume else 'built'}); "
        f"building {settings.examples} examples")
    data = build_dataset(settings, tokenizer_file)
    log(f"data: {tuple(data['cond_ids'].shape)} tokens, {int(data['has_cond'].sum())} edits")

    model = HunyuanImage3ForCausalMM(config).float().to(settings.device)
    meta: dict = {"settings": asdict(settings), "torch": torch.__version__,
                  "tokenizer": f"{settings.resume}/tokenizer.json" if settings.resume else "spec.build_tokenizer()",
                  "device": torch.cuda.get_device_name() if settings.device.startswith("cuda") else "cpu"}
    if settings.resume:
        load_pretrained(model, settings.resume)
        previous = json.loads((Path(settings.resume) / "train_meta.json").read_text())
        meta["resumed_from"] = previous
        meta |= {k: previous[k] for k in ("vae_steps", "vae_final_loss", "vae_seconds") if k in previous}
    else:
        meta |= train_vae(model.vae, data, settings, log)
    target_mean, _ = encode_all(model.vae, data["target"], settings.device)
    source_mean, source_std = encode_all(model.vae, data["source"], settings.device)
    if settings.resume:
        loaded = json.loads((Path(settings.resume) / "config.json").read_text())["vae"]
        shift, scale = loaded["shift_factor"], loaded["scaling_factor"]
    else:
        shift, scale = float(target_mean.mean()), float(1.0 / target_mean.std())
    config = config.replace(vae=dataclasses.replace(config.vae, shift_factor=shift, scaling_factor=scale))
    model.config = config
    model.vae.shift_factor, model.vae.scaling_factor = shift, scale
    log(f"latents: shift {shift:.4f} scale {scale:.4f}")
    latents = {"target_mean": target_mean, "source_mean": source_mean, "source_std": source_std,
               "shift": shift, "scale": scale}
    meta |= train_transformer(model, data, latents, settings, log)
    meta["command"] = ("python -m components.demo.train " + " ".join(sys.argv[1:] if argv is None else argv)
                       + f"  # reproduce exactly: --vae-steps {meta.get('vae_steps')} --dit-steps {meta['dit_steps']}")
    meta["seconds"] = round(time.time() - started, 1)
    save_checkpoint(model, config, backend, out, meta)
    log(f"wrote {out}: {json.dumps({k: v for k, v in meta.items() if k not in ('settings', 'resumed_from')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
