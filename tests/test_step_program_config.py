"""The AR and DiT step programs make one JobConfig from their flags and call the step with it."""

from __future__ import annotations

import pytest

import components.ar.__main__ as ar_main
import components.dit.__main__ as dit_main
from components.jobconfig import JobConfig


@pytest.fixture
def called(monkeypatch) -> dict:
    """What the program hands run_step (the step's keywords), instead of running the step."""
    seen: dict = {}
    for program in (ar_main, dit_main):
        monkeypatch.setattr(program, "run_step", lambda step, kwargs, progress, **kw: seen.update(kwargs) or {})
    return seen


def _config(tmp_path, **fields) -> JobConfig:
    return JobConfig(dataset="", output=str(tmp_path), run_id="r", device="cpu", **fields)


def test_the_ar_flags_make_the_steps_config(tmp_path, called):
    argv = ["--output", str(tmp_path), "--run-id", "r", "--shard", "1", "--device", "cpu", "--batch-size", "3",
            "--max-new-tokens", "4", "--greedy", "--quantization", "none", "--kv-store", ""]
    assert ar_main.main(argv) == 0
    assert called == {"config": _config(tmp_path, batch_size=3, max_new_tokens=4, greedy=True), "shard": 1}


def test_the_dit_flags_make_the_steps_config_and_keep_its_own_switches(tmp_path, called):
    argv = ["--output", str(tmp_path), "--run-id", "r", "--shard", "0", "--device", "cpu", "--steps", "2",
            "--no-kv-reuse", "--save-latents", "--step-cache", "", "--no-prefetch"]
    assert dit_main.main(argv) == 0
    assert called == {"config": _config(tmp_path, steps=2, kv_reuse=False, save_latents=True), "shard": 0,
                      "prefetch": False}
