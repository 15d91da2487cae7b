"""Tiny checkpoints in the official HunyuanImage-3.0 layout, written by the tests (never downloaded).

    config.json                     the released schema (per-layer MoE lists, vae/vit dicts, dtype)
    model-0000k-of-0000n.safetensors + model.safetensors.index.json    official tensor names
    generation_config.json          the released keys (Instruct or Distil values, tiny budgets)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    system_prompt.py                the official file's structure with short texts

`instruct` and `distil` (Instruct-Distil: <guidance> / <timestep_r> embedders, cfg_distilled,
use_meanflow, 8 steps at guidance 2.5 as a token) variants.
"""

from __future__ import annotations

from pathlib import Path

import torch

from components.engine.config import tiny_config
from components.engine.generation_config import GenerationConfig, write_generation_config_file
from components.engine.system_prompts import write_system_prompt_file
from components.engine.tokenizer import write_tokenizer_files
from components.engine.transformer import HunyuanImage3ForCausalMM
from components.engine.weights import init_dummy_weights, save_pretrained

VARIANTS = ("instruct", "distil")


def tiny_official_config(variant: str = "instruct"):
    distil = variant == "distil"
    name = "HunyuanImage-3.0-Instruct-Distil" if distil else "HunyuanImage-3.0-Instruct"
    return tiny_config().replace(cfg_distilled=distil, use_meanflow=distil, model_version=name,
                                 extra={"moe_impl": "eager", "transformers_version": "4.57.1"})


def generation_config(variant: str = "instruct") -> GenerationConfig:
    """The released Instruct / Instruct-Distil generation_config.json keys, with tiny budgets."""
    distil = variant == "distil"
    return GenerationConfig(diff_infer_steps=8 if distil else 4, diff_guidance_scale=2.5 if distil else 5.0,
                            flow_shift=3.0, bot_task="think_recaption", use_system_prompt="en_unified",
                            sequence_template="instruct", max_new_tokens=12, do_sample=True, temperature=0.6,
                            top_k=1024, top_p=0.95, drop_think=False, max_length=4096)


@torch.no_grad()
def write_official_checkpoint(directory: str | Path, variant: str = "instruct", seed: int = 11,
                              max_shard_bytes: int = 1 << 20) -> Path:
    directory = Path(directory)
    config = tiny_official_config(variant)
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(config)
    model = model.to_empty(device="cpu").float()
    init_dummy_weights(model, seed)
    save_pretrained(model, config, directory, max_shard_bytes=max_shard_bytes)
    return write_tiny_checkpoint_files(directory, variant)


def write_tiny_checkpoint_files(directory: str | Path, variant: str = "instruct") -> Path:
    """The files beside the weights: tokenizer, system_prompt.py, generation_config.json."""
    directory = Path(directory)
    write_tokenizer_files(directory)
    write_system_prompt_file(directory)
    write_generation_config_file(directory, generation_config(variant))
    return directory
