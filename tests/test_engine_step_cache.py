"""The DiT's first-block step cache (opt-in, approximate): off is the exact path bit for bit, a
threshold nothing passes changes nothing, a loose one skips steps (and then changes the latents),
and the option is checked and remembered like every DiT setting."""

from __future__ import annotations

import pytest
import torch

from components.engine import ARRequest, DiTRequest, SamplingParams
from components.errors import ConfigError
from components.options import check_engine_options

from .test_engine_helpers import random_image, stub_vae_decode, tiny_engine

STEPS = 12


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def edit(engine):
    req = ARRequest("e", "make the sky purple", [random_image(128, 96, seed=3)])
    return engine.generate_ar([req], SamplingParams(temperature=0, max_new_tokens=8))[0], req.images


@pytest.fixture(autouse=True)
def _no_decode(monkeypatch):
    stub_vae_decode(monkeypatch)


def _run(engine, edit, step_cache: float):
    ar, images = edit
    return engine.dit(DiTRequest(ar, images, ar.prompt_kv, steps=STEPS, step_cache=step_cache))


def test_off_and_unreachable_threshold_are_the_exact_path(engine, edit):
    exact = _run(engine, edit, 0.0)
    assert "dit_steps_skipped" not in exact.timings
    strict = _run(engine, edit, 1e-12)  # runs the first layer apart, then the rest: same arithmetic
    assert strict.timings["dit_steps_skipped"] == 0
    assert torch.equal(strict.latents, exact.latents)


def test_loose_threshold_skips_steps_and_changes_the_result(engine, edit):
    exact = _run(engine, edit, 0.0)
    loose = _run(engine, edit, 0.99)
    skipped = loose.timings["dit_steps_skipped"]
    assert 0 < skipped < STEPS  # the first step always runs in full
    assert not torch.equal(loose.latents, exact.latents)
    # approximate, not broken: the skipped steps reuse real residuals
    cos = torch.nn.functional.cosine_similarity(loose.latents.flatten(), exact.latents.flatten(), dim=0)
    assert cos > 0.5


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), True])
def test_bad_step_cache_is_one_config_error(bad):
    with pytest.raises(ConfigError, match="--step-cache"):
        check_engine_options(step_cache=bad)


def test_step_cache_is_a_remembered_dit_setting():
    from components.dit.run import dit_settings
    from components.jobconfig import JobConfig

    gen = {"steps": 8, "guidance": 5.0, "flow_shift": 3.0}
    config = JobConfig(dataset="d", output="o", run_id="r")
    a = dit_settings(config, gen)
    b = dit_settings(config.replace(step_cache=0.1), gen)
    assert a["step_cache"] == 0.0 and b["step_cache"] == 0.1  # a resume with another value is refused
