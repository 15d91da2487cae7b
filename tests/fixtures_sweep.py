"""Synthetic runs for the evaluate / sweep / report tests: real PNGs and rows.parquet in the run
layout, without the engine.

`fake_runner` stands in for `pipeline.local.run_job`: it renders a procedural scene per row and
perturbs it the way the knobs of a real job would (known, seeded perturbations, so the metrics have
expected values): recompute adds N(0, 0.004) noise, fewer steps blur the image and add N(0, 0.03)
noise, another seed changes the scene and the generated tokens after a shared prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageFilter

from components.data.datasets import SHARD_SCHEMA, Job
from components.data.runs import row_key
from components.sweep.runner import JobOutcome

ROW_IDS = ["r0", "r1", "r2", "r3"]
WIDTH, HEIGHT = 96, 64
REF_STEPS = 8
PROMPT_TOKENS = 5  # generated ids share this prefix across seeds
RECOMPUTE_SIGMA = 0.004
FEW_STEPS_SIGMA = 0.03


def scene(index: int, seed: int = 42, width: int = WIDTH, height: int = HEIGHT) -> np.ndarray:
    """A small landscape (sky gradient, sun, two hill layers) as float RGB in [0, 1]."""
    rng = np.random.default_rng(1000 * index + seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    top = np.array([0.15 + 0.15 * index, 0.35, 0.75 - 0.1 * index])
    bottom = np.array([0.95, 0.75 - 0.05 * index, 0.55])
    t = (y / (height - 1))[..., None]
    img = top * (1 - t) + bottom * t
    cx, cy, r = rng.uniform(0.2, 0.8) * width, rng.uniform(0.15, 0.4) * height, height * 0.14
    sun = np.clip(1.2 - np.hypot(x - cx, y - cy) / r, 0, 1)[..., None]
    img = img * (1 - sun) + np.array([1.0, 0.9, 0.55]) * sun
    for layer, (shade, base) in enumerate(((0.45, 0.62), (0.25, 0.78))):
        phase, freq = rng.uniform(0, 6.28), rng.uniform(1.5, 3.5)
        ridge = height * (base + 0.08 * np.sin(freq * x / width * 6.28 + phase) + 0.02 * layer * np.cos(x / 5))
        mask = (y > ridge)[..., None]
        hill = np.array([0.1 + 0.05 * index, shade + 0.1 * layer, 0.2]) * (0.85 + 0.15 * (y / height))[..., None]
        img = np.where(mask, hill, img)
    return np.clip(img, 0, 1)


def to_uint8(img: np.ndarray) -> np.ndarray:
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)


def write_run(
    output: Path, run_id: str, rows: list[dict[str, Any]], num_shards: int = 2, ids_as_json: bool = False
) -> Path:
    """Write a run in the run layout. Each row: id, image (uint8 HxWx3 or None), and any of
    status, error, cot_text, generated_ids, kv_path, timings (dict), latents (tensor)."""
    run = Path(output) / run_id
    (run / "inputs").mkdir(parents=True, exist_ok=True)
    for k in range(num_shards):
        shard = run / "shards" / str(k)
        (shard / "images").mkdir(parents=True, exist_ok=True)
        jobs = [Job(rows[i]["id"], i, "edit", rows[i].get("prompt", f"make row {rows[i]['id']} look like a sunset"),
                    image=input_png(i)) for i in range(k, len(rows), num_shards)]  # fmt: skip
        pq.write_table(pa.Table.from_pylist([j.to_record() for j in jobs], schema=SHARD_SCHEMA),
                       run / "inputs" / f"{k}.parquet")  # what the shard step writes
        records = []
        for index in range(k, len(rows), num_shards):
            row = rows[index]
            rid = row["id"]
            image_key = ""
            name = row_key(rid)  # as the DiT step names a row's objects
            if row.get("image") is not None:
                Image.fromarray(row["image"]).save(shard / "images" / f"{name}.png")
                image_key = f"{run_id}/shards/{k}/images/{name}.png"
            if row.get("latents") is not None:
                (shard / "latents").mkdir(exist_ok=True)
                torch.save(row["latents"], shard / "latents" / f"{name}.pt")
            img = row.get("image")
            rec = {
                "id": rid,
                "row_index": index,
                "status": row.get("status", "ok"),
                "error": row.get("error", ""),
                "image_key": image_key,
                "prompt": row.get("prompt", f"make row {rid} look like a sunset"),
                "cot_text": row.get("cot_text", ""),
                "width": int(img.shape[1]) if img is not None else None,
                "height": int(img.shape[0]) if img is not None else None,
                "kv_path": row.get("kv_path", "reuse"),
                "kv_reason": row.get("kv_reason", ""),
                "generated_ids": json.dumps(row.get("generated_ids", []))
                if ids_as_json
                else row.get("generated_ids", []),
            }
            rec.update(row.get("timings", {}))
            records.append(rec)
        pq.write_table(pa.Table.from_pylist(records), shard / "rows.parquet")
        (shard / "_COMMITTED").write_text("")
    (run / "summary.json").write_text(json.dumps({"run_id": run_id, "rows": len(rows)}))
    return run


def input_png(index: int) -> bytes:
    """The row's input image (an edit's source) as PNG bytes: the scene at noon, smaller."""
    import io

    buf = io.BytesIO()
    Image.fromarray(to_uint8(scene(index, seed=7, width=48, height=32))).save(buf, format="PNG")
    return buf.getvalue()


def cot_for(index: int, seed: int) -> str:
    rng = np.random.default_rng(seed * 7 + index)
    words = ["warm", "orange", "sky", "soft", "light", "hills", "glow", "dusk", "calm", "clouds"]
    return f"The user wants a sunset for row {index}. " + " ".join(rng.choice(words, 24))


def tokens_for(index: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed * 13 + index)
    return list(range(100, 100 + PROMPT_TOKENS)) + [int(t) for t in rng.integers(1000, 2000, 20)]


def fake_rows(params: dict[str, Any], ids: list[str] = ROW_IDS, width: int = WIDTH,
              height: int = HEIGHT) -> list[dict[str, Any]]:
    seed = int(params.get("seed", 42))
    steps = int(params.get("steps", REF_STEPS))
    reuse = bool(params.get("kv_reuse", True))
    rows = []
    for i, rid in enumerate(ids):
        img = scene(i, seed, width, height)
        latents = torch.from_numpy(np.random.default_rng(seed + i).standard_normal((4, 4, 6)))
        noise = np.random.default_rng(10_000 + 31 * i + steps)
        if not reuse:
            img = img + noise.normal(0, RECOMPUTE_SIGMA, img.shape)
            latents = latents + 0.01
        if steps < REF_STEPS:
            blurred = Image.fromarray(to_uint8(img)).filter(ImageFilter.GaussianBlur(1.2))
            img = np.asarray(blurred) / 255.0 + noise.normal(0, FEW_STEPS_SIGMA, img.shape)
            latents = latents * 0.9
        rows.append(
            {
                "id": rid,
                "image": to_uint8(img),
                "cot_text": cot_for(i, seed),
                "generated_ids": tokens_for(i, seed),
                "kv_path": "reuse" if reuse else "recompute",
                "latents": latents.float(),
                "timings": {
                    "ar_prefill_s": 0.12,
                    "ar_decode_s": 0.30,
                    "dit_total_s": 0.06 * steps * (0.8 if reuse else 1.0),
                    "vae_decode_s": 0.05,
                },
            }
        )
    return rows


def fake_runner(params: dict[str, Any], output: Path, run_id: str, ar_from: str | None) -> JobOutcome:
    """Drop-in for run_job_adapter: writes a synthetic run (AR outputs are seed-deterministic, so
    taking them from another run changes nothing and the runner reports them as pinned)."""
    write_run(Path(output), run_id, fake_rows(params), num_shards=int(params.get("num_shards", 2)))
    return JobOutcome(result={"run_id": run_id}, ar_pinned=ar_from is not None)


def spec_dict(**over: Any) -> dict[str, Any]:
    """A sweep spec like examples/sweeps/tiny.yaml over the synthetic dataset."""
    spec: dict[str, Any] = {
        "name": "synthetic",
        "description": "synthetic runs for tests",
        "base": {
            "dataset": "synthetic",
            "kind": "edit",
            "model": "tiny",
            "num_shards": 2,
            "steps": REF_STEPS,
            "guidance": 5.0,
            "seed": 42,
            "kv_reuse": True,
        },
        "grid": {"kv_reuse": [True, False], "steps": [REF_STEPS, 4]},
        "reference": {"kv_reuse": True, "steps": REF_STEPS},
        "thresholds": {"psnr_min": 30, "ssim_min": 0.97, "mean_abs_max": 0.03, "p99_abs_max": 0.30},
        "precision_budget": {"determinism": True, "reuse_drift": True, "ar_diversity": {"seed": 43}},
    }
    spec.update(over)
    return spec
