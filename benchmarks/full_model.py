"""The full-size 32-layer model end to end on one GPU: one IT2I row through AR and DiT.

    python benchmarks/full_model.py --quantization fp8 --steps 8 50 --out $OUT/full_model.json

Dummy weights at the released dimensions (80B parameters; with --quantization fp8 the decoder
layers are drawn and quantized one at a time, so the bf16 model never exists whole and the model
fits one H200), one 1024x1024 conditioning image, a think_recaption CoT of a few hundred tokens
(the stage budget caps it), then the DiT at each step count reusing the AR's prompt KV, and the
VAE decode. Prints a table: GPU memory, seconds per stage, images per GPU-hour; writes JSON.

Images per GPU-hour here = 3600 / (AR + DiT seconds of one image on this one GPU), batch 1: a
lower bound for a deployment that batches AR rows and overlaps AR and DiT on separate GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gb(n: int) -> float:
    return round(n / 1e9, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="hunyuan-image-3")
    p.add_argument("--quantization", default="fp8", help="fp8 | none")
    p.add_argument("--steps", type=int, nargs="+", default=[8, 50])
    p.add_argument("--cot-tokens", type=int, default=320, help="CoT budget (think + recaption, tags included)")
    p.add_argument("--image-size", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--ar-batch", type=int, default=1, help="AR rows decoded together (the DiT runs one of them)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "full_model.json"))
    args = p.parse_args()

    from PIL import Image

    from components.engine import Engine
    from components.engine.ar import ARRequest, ForcedCot, SamplingParams
    from components.engine.dit import DiTRequest

    quant = None if args.quantization in ("", "none") else args.quantization
    result: dict = {"model": args.model, "quantization": quant or "bf16", "device": torch.cuda.get_device_name(0)
                    if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    t0 = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, quantization=quant, dtype="bfloat16")
    _sync()
    result["load_s"] = round(time.perf_counter() - t0, 1)
    result["weights_gb"] = _gb(torch.cuda.memory_allocated()) if torch.cuda.is_available() else None
    print(f"loaded in {result['load_s']} s, {result['weights_gb']} GB on the GPU", flush=True)
    # random weights would end a CoT at an arbitrary token: no tag is sampled, every row runs to the
    # budget (the engine still closes each stage with its end tags, then the ratio token)
    engine.ar.forced_cot = ForcedCot(str(args.cot_tokens))

    rng = torch.Generator().manual_seed(0)
    pixels = (torch.rand(args.image_size, args.image_size, 3, generator=rng) * 255).to(torch.uint8).numpy()
    image = Image.fromarray(pixels)
    requests = [ARRequest(f"bench{i}", "Make the sky a warm sunset and add a small red boat on the water.",
                          [image], image_size="auto", bot_task="think_recaption", seed=1 + i)
                for i in range(args.ar_batch)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.cot_tokens)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    ar = engine.generate_ar(requests, sampling)[0]
    _sync()
    ar_batch_s = time.perf_counter() - t0
    ar_s = ar_batch_s / args.ar_batch  # one row's share of the batch
    kv = ar.prompt_kv
    result["ar"] = {"batch": args.ar_batch, "batch_seconds": round(ar_batch_s, 2), "seconds": round(ar_s, 2),
                    "prefill_s": round(ar.timings["ar_prefill_s"], 3),
                    "decode_s": round(ar.timings["ar_decode_s"], 2), "prompt_tokens": ar.timings["prompt_tokens"],
                    "generated_tokens": ar.timings["generated_tokens"],
                    "decode_ms_per_token": round(1000 * ar.timings["ar_decode_s"] / max(1, ar.timings["ar_decode_steps"]), 1),
                    "kv_gb": _gb(kv.nbytes()) if kv is not None else 0, "image_size": list(ar.image_size),
                    "peak_gb": _gb(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None}
    print(f"AR {result['ar']}", flush=True)

    result["dit"] = {}
    for steps in args.steps:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _sync()
        t0 = time.perf_counter()
        out = engine.dit(DiTRequest(ar, [image], kv, steps=steps, guidance_scale=5.0, seed=1))
        _sync()
        total = time.perf_counter() - t0
        step_s = out.timings["dit_step_s"]
        key = f"{steps}_warm" if steps in result["dit"] else steps  # a repeated count: compiled graphs reused
        result["dit"][key] = {
            "seconds": round(total, 2), "kv_path": out.kv_path, "prefix_s": round(out.timings["dit_prefix_s"], 3),
            "first_step_s": round(step_s[0], 3), "step_s_median": round(sorted(step_s)[len(step_s) // 2], 3),
            "vae_decode_s": round(out.timings["vae_decode_s"], 2),
            "peak_gb": _gb(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None,
            "image_gpu_seconds": round(ar_s + total, 2), "img_per_gpu_hour": round(3600 / (ar_s + total), 1)}
        print(f"DiT {key} steps {result['dit'][key]}", flush=True)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{'':22}{'seconds':>10}{'peak GB':>10}{'img/GPU-h':>11}")
    print(f"{'AR (prefill + CoT)':22}{result['ar']['seconds']:>10}{result['ar']['peak_gb'] or 0:>10}")
    for steps, d in result["dit"].items():
        print(f"{f'DiT {steps} steps + VAE':22}{d['seconds']:>10}{d['peak_gb'] or 0:>10}{d['img_per_gpu_hour']:>11}")
    print("vLLM-Omni IT2I CI: 168 img/GPU-h (4xH100, AR TP2 + DiT TP2, 8 steps, concurrency 16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
