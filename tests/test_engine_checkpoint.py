"""A tiny checkpoint in the official layout loads as published and runs: Instruct and Instruct-Distil.

- the engine loads config.json (released schema), the sharded safetensors (strictly), the
  generation config, the tokenizer files and system_prompt.py from the directory;
- Distil runs one CFG row with the `<guidance>` token (1000 x scale, bf16-rounded as official) and
  the `<timestep_r>` token (the next timestep), and its reuse equals recompute;
- what a real checkpoint can lack or get wrong is one clear error.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from components.engine import Engine
from components.engine.ar import ARRequest, SamplingParams
from components.engine.dit import DiTRequest
from components.engine.weights import CheckpointError

from .fixtures_checkpoint import VARIANTS, generation_config, write_official_checkpoint
from .test_engine_helpers import psnr, random_image

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {v: write_official_checkpoint(tmp_path_factory.mktemp(f"ckpt_{v}"), v) for v in VARIANTS}


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {v: Engine.load(str(path)) for v, path in checkpoints.items()}


def test_layout_is_the_official_one(checkpoints):
    d = checkpoints["instruct"]
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "system_prompt.py"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 2
    config = json.loads((d / "config.json").read_text())
    assert config["moe_topk"] == [2, 2] and config["dtype"] == "float32" and "vit_processor" in config
    distil = json.loads((checkpoints["distil"] / "config.json").read_text())
    assert distil["cfg_distilled"] is True and distil["use_meanflow"] is True
    index = json.loads((checkpoints["distil"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("guidance_emb.") for n in index) and any(n.startswith("timestep_r_emb.") for n in index)
    assert not any(n.startswith("guidance_emb.") for n in
                   json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_loads_everything_from_the_directory(checkpoints, engines, variant):
    engine = engines[variant]
    assert engine.generation_config == generation_config(variant)
    assert engine.system_prompts is not None and set(engine.system_prompts) >= {"en_unified", "en_vanilla"}
    assert engine.model_id == checkpoints[variant].name
    assert engine.load_stats.tensors > 100 and engine.load_stats.peak_host_rss_gb > 0
    assert hasattr(engine.model, "guidance_emb") == (variant == "distil")
    # the weights are the saved ones: reloading with another seed changes nothing
    again = Engine.load(str(checkpoints[variant]), seed=123)
    for (name, a), (_, b) in zip(engine.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_it2i_runs_and_reuse_equals_recompute(engines, variant):
    engine = engines[variant]
    image = random_image(96, 64, seed=5)
    out = engine.generate_ar([ARRequest("row", "make the sky purple", [image], seed=3)], GREEDY)[0]
    assert out.bot_task == "think_recaption" and out.prompt_kv is not None  # from generation_config.json
    reuse = engine.dit(DiTRequest(out, [image], out.prompt_kv))
    recompute = engine.dit(DiTRequest(out, [image], None))
    assert (reuse.kv_path, recompute.kv_path) == ("reuse", "recompute")
    assert reuse.timings["dit_steps"] == generation_config(variant).diff_infer_steps
    assert (reuse.latents - recompute.latents).abs().max().item() <= 1e-4
    assert psnr(reuse.image, recompute.image) >= 60
    assert recompute.latents.abs().max() > 0.5


def test_distil_runs_one_row_with_guidance_and_timestep_r_tokens(engines, monkeypatch):
    engine = engines["distil"]
    seen: dict[str, list] = {"guidance": [], "timestep_r": [], "rows": []}
    model = engine.model
    plain_g, plain_r = model.guidance_tokens, model.timestep_r_tokens
    monkeypatch.setattr(model, "guidance_tokens", lambda g: (seen["guidance"].append(g.item()), plain_g(g))[1])
    monkeypatch.setattr(model, "timestep_r_tokens", lambda r: (seen["timestep_r"].append(r.item()), plain_r(r))[1])
    plain_reuse = engine.dit.prefix_from_reuse

    def rows(*args, **kwargs):
        cache = plain_reuse(*args, **kwargs)
        seen["rows"].append(cache.k[0].shape[0])
        return cache

    monkeypatch.setattr(engine.dit, "prefix_from_reuse", rows)
    out = engine.generate_ar([ARRequest("row", "a red boat", seed=3)], GREEDY)[0]
    engine.dit(DiTRequest(out, [], out.prompt_kv, steps=3))
    assert seen["rows"] == [1]  # cfg distilled: no unconditional row
    assert seen["guidance"] == [2496.0] * 3  # 1000 x 2.5 rounded through bfloat16, as the official pipeline
    from components.engine.dit import official_scheduler

    expected_r = (official_scheduler(3, 3.0).sigmas[1:] * 1000).tolist()
    assert seen["timestep_r"] == pytest.approx(expected_r)


def test_distil_guidance_token_changes_the_image(engines):
    engine = engines["distil"]
    out = engine.generate_ar([ARRequest("row", "a red boat", seed=3)], GREEDY)[0]
    a = engine.dit(DiTRequest(out, [], out.prompt_kv, steps=2, guidance_scale=2.5))
    b = engine.dit(DiTRequest(out, [], out.prompt_kv, steps=2, guidance_scale=6.0))
    assert (a.latents - b.latents).abs().max() > 1e-3


# ------------------------------------------------------------------------------ what can go wrong
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_distil_weights_missing_is_a_clear_error(checkpoints, tmp_path):
    """A Distil config.json over an Instruct checkpoint's weights: the extra embedders must load."""
    d = _copy(checkpoints["instruct"], tmp_path / "ckpt")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "cfg_distilled": True, "use_meanflow": True}))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(e\.g\. guidance_emb"):
        Engine.load(str(d))


@pytest.mark.parametrize("missing,message", [
    ("system_prompt.py", r"system_prompt\.py"),
    ("generation_config.json", r"has no generation_config\.json"),
])
def test_missing_files_are_one_line_errors(checkpoints, tmp_path, missing, message):
    d = _copy(checkpoints["instruct"], tmp_path / "ckpt")
    (d / missing).unlink()
    with pytest.raises(ValueError, match=message) as e:
        Engine.load(str(d))
    assert "\n" not in str(e.value)


def test_incomplete_download_is_a_clear_error(checkpoints, tmp_path):
    d = _copy(checkpoints["instruct"], tmp_path / "ckpt")
    sorted(d.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(CheckpointError, match=r"lacks 1 shard.*incomplete"):
        Engine.load(str(d))
