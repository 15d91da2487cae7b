"""Where reuse and recompute diverge: the AR-exported prefix K/V against the DiT's own prefill of
the same tokens, layer by layer, split into the prompt part and the decoded (CoT) part, for each
kernel choice. Tiny model, one T2I and one IT2I row.

    python3 benchmarks/diagnose_reuse.py --device cuda --dtype bfloat16 --out $OUT/diagnose.json

Variants: plain kernels; the fast kernels with the decoded tokens' K/V as the graph decode wrote
them; the fast kernels with those K/V written again by one prefill chunk (ar.PREFILL_DECODED_KV).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from PIL import Image

from components.engine import ARRequest, Engine, SamplingParams, kernels
from components.engine import ar as ar_module
from components.engine.inputs import request_generator
from components.engine.sequence import first_difference

VARIANTS = (("plain", "plain", True), ("fast_decode_kv", "fast", False), ("fast_prefilled_kv", "fast", True))


def diverge(engine, request: ARRequest, images: list) -> dict:
    out = engine.generate_ar([request], SamplingParams(temperature=0, max_new_tokens=24))[0]
    seq = out.dit_sequence(engine.dit.builder)
    n = out.prompt_kv.length if hasattr(out.prompt_kv, "length") else len(out.prompt_kv.token_ids)
    same = min(n, first_difference(out.fed_ids, seq.cond_ids))  # tokens both paths hold
    prompt = len(out.prompt_ids)
    # the DiT's stream: conditioning latents drawn as the AR drew them (same seed)
    generator = request_generator(engine.model, out.seed)
    with engine.model.autocast():  # as DiTGenerator.__call__ runs it
        cache = engine.dit.prefix_from_scratch(seq, images, cfg_on=False, generator=generator)
    worst = {"prompt": 0.0, "decoded": 0.0}
    first_layer = {"prompt": None, "decoded": None}
    for layer in range(len(cache.k)):
        for kind, mine, theirs in (("k", out.prompt_kv.keys[layer], cache.k[layer]),
                                   ("v", out.prompt_kv.values[layer], cache.v[layer])):
            dit = theirs[0, :, :same].transpose(0, 1).float()
            diff = (dit - mine[:same].float()).abs().amax(dim=(1, 2))
            for part, rows in (("prompt", diff[:prompt]), ("decoded", diff[prompt:])):
                if rows.numel() and rows.max().item() > 0:
                    worst[part] = max(worst[part], rows.max().item())
                    if first_layer[part] is None:
                        first_layer[part] = f"{kind}{layer}"
    return {"prompt_tokens": prompt, "decoded_tokens_reused": max(0, same - prompt), "reuse_len": n,
            "max_abs_diff": worst, "first_differing_layer": first_layer}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cond = Image.fromarray((np.random.RandomState(0).rand(192, 256, 3) * 255).astype("uint8"))
    results: dict = {}
    for name, spec, prefilled in VARIANTS:
        kernels.configure(spec)
        ar_module.PREFILL_DECODED_KV = prefilled
        engine = Engine.load("tiny", device=args.device, dtype=args.dtype)
        with torch.no_grad():
            results[name] = {
                "t2i": diverge(engine, ARRequest("t2i", "make the sky purple", [], bot_task="think_recaption"), []),
                "it2i": diverge(engine, ARRequest("it2i", "make the sky purple", [cond], bot_task="think_recaption"),
                                [cond]),
            }
        print(name, json.dumps(results[name]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
