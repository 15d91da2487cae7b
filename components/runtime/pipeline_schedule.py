"""DiT denoising of a group of rows across pipeline stages, as a wavefront that keeps every stage busy.

One row's denoising step is a chain through the stages (stage 0's layers, then stage 1's, ...), so
a single row leaves all stages but one idle. With M rows in flight (M >= the number of stages) the
stages work on different (step, row) items at once:

    every stage, in the same order:  for step i: for row m in the group: item (i, m)
    stage 0:      x = the row's step tokens from its latents (for i > 0 the latents come back
                  from the last stage), its layers, isend x to stage 1
    stage s:      recv x from stage s - 1, its layers, isend to stage s + 1
    last stage:   recv, its layers, the image head + CFG + scheduler step -> the row's new latents,
                  isend them back to stage 0 (a second communicator, so the way back never queues
                  behind the hand-offs forward)

A row's CFG pair is one microbatch (one forward of batch 2). Sends never block (isend) and each
stage only blocks on receiving its next item, whose sender comes earlier in the same order: no
deadlock. Stage 0 receives row m's step-i latents while it has M - 1 other items to work on, so with
M >= stages the pipeline does not drain between steps. Every item is the same computation as
`DiTGenerator.__call__` does for the row alone (same modules, same inputs), so the images equal the
row-by-row ones. The rows' prefix K/V (`DiTGenerator.prepare`) go through the stages the same way, one
row after the other without waiting for the later stages (each stage needs only its own layers' K/V
of a prefix); every stage first agrees on each row's K/V path, so no collective sits between them.
The VAE decodes are shared out (row i on stage i mod stages, the pixels sent to stage 0, which
writes the images).
"""

from __future__ import annotations

import time

import torch

from components.engine import kernels
from components.engine.dit import DenoisingRow, DiTGenerator, DiTOutput, DiTRequest

# Rows a DiT step keeps in flight per pipeline stage: 2 leaves slack for the latents' way back
# (at exactly one per stage, stage 0 would wait for each row's round trip).
ROWS_PER_STAGE = 2


def rows_in_flight(model) -> int:
    """How many of a shard's rows the DiT denoises together: 1 without pipeline stages."""
    pp = model.pipeline
    return 1 if pp is None else ROWS_PER_STAGE * pp.pp_size


@torch.no_grad()
def denoise_rows(dit: DiTGenerator, requests: list[DiTRequest]) -> list[DiTOutput]:
    """The DiT outputs of `requests`, denoised together in a pipeline wavefront (the model must run
    in several pipeline stages; every stage calls this with the same requests)."""
    model = dit.model
    pp = model.pipeline
    if pp is None:
        raise ValueError("denoise_rows needs a model in pipeline stages (pipeline_parallel_size > 1)")
    with model.autocast():
        t_prepare = time.perf_counter()
        # every stage agrees on each row's path first (a collective per row); then the rows' prefix
        # forwards need none: stage 0 goes on to the next row's prefix while stage 1 runs this one's
        decisions = [dit.kv_decision(req) for req in requests]
        sends: list = []
        rows = [dit.prepare(req, decision, stage_sends=sends) for req, decision in zip(requests, decisions)]
        t0 = time.perf_counter()
        for i in range(max(row.steps for row in rows)):
            for row in rows:
                if i < row.steps:
                    sends.append(_item(dit, pp, row, i))
                    sends = [w for w in sends if w is not None and not w.is_completed()]  # free what arrived
        pp.wait_all(sends)
        for row in rows:  # the final latents on every stage
            row.latents = pp.broadcast_from_last_stage(row.latents.float())
        t1 = time.perf_counter()
        per_item = (t1 - t0) / max(1, sum(row.steps for row in rows))
        for row in rows:  # the group's denoising time shared out over its items
            row.timings["dit_step_s"] = [per_item] * row.steps
            row.timings["dit_rows_in_flight"] = len(rows)
        outputs = _finish_rows(dit, pp, rows)
        # where the group's time went (each row carries its group's): the prefixes (one row at a time
        # through the stages), the wavefront, the VAE decodes and hand-offs
        group = {"prepare": t0 - t_prepare, "denoise": t1 - t0, "finish": time.perf_counter() - t1}
        for out in outputs:
            out.timings["dit_group_s"] = {k: round(v, 4) for k, v in group.items()}
        return outputs


def _finish_rows(dit: DiTGenerator, pp, rows: list[DenoisingRow]) -> list[DiTOutput]:
    """The rows' images, the VAE decodes shared out over the stages (row i on stage i mod stages);
    the other stages send their pixels to stage 0, whose first rank writes every image. A stage
    other than 0 returns images only for the rows it decoded (it writes nothing)."""
    t0 = time.perf_counter()
    pixels: list[torch.Tensor | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        if i % pp.pp_size == pp.pp_rank:
            pixels[i] = dit.model.vae.decode(row.latents)
    for i in range(len(rows)):  # in row order on every stage
        stage = i % pp.pp_size
        if stage == 0:
            continue
        if pp.pp_rank == stage:
            pp.send_stage(pixels[i], 0)
        elif pp.pp_rank == 0:
            pixels[i] = pp.recv_any_stage(stage)
    decode_s = (time.perf_counter() - t0) / len(rows)
    outputs = []
    for row, decoded in zip(rows, pixels):
        out = dit.finish(row, decoded, want_image=decoded is not None)  # None: decoded on another stage
        out.timings["vae_decode_s"] += decode_s
        outputs.append(out)
    return outputs


def _item(dit: DiTGenerator, pp, row: DenoisingRow, i: int):
    """This stage's part of row `row`'s step `i`; returns the Work of what it sent on."""
    model = dit.model
    batch = row.cache.k[0].shape[0]
    positions, mask = row.step
    first, last = pp.pp_rank == 0, pp.is_last_stage
    if first:
        if i > 0:  # the last stage computed the latents of step i - 1
            row.latents = pp.recv_stage(torch.empty_like(row.latents, dtype=torch.float32).contiguous(),
                                        pp.pp_size - 1, back=True)
        x = dit.step_tokens(row.latents, row.t(i), row.guidance, row.t_r(i), batch).to(model.dtype).contiguous()
    else:
        gen = row.seq.gen_image
        shape = (batch, gen.end - gen.timestep_index, model.config.hidden_size)
        x = pp.recv_stage(torch.empty(shape, dtype=model.dtype, device=model.device), pp.pp_rank - 1)
    compiled = kernels.enabled("compile", x, "on")
    hidden = model.forward_layers(x, positions, mask, row.cache, compiled=compiled, layers=model.stage_layers)
    if not last:
        return pp.isend_stage(hidden.to(model.dtype).contiguous(), pp.pp_rank + 1)
    velocity = dit.guided(hidden, row.seq, row.t(i), row.guidance, row.req.guidance_rescale)
    row.latents = row.scheduler.step(velocity, row.scheduler.timesteps[i], row.latents).prev_sample.float()
    if i + 1 < row.steps:
        return pp.isend_stage(row.latents.contiguous(), 0, back=True)
    return None
