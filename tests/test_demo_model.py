"""The demo model (--model demo) on CPU does what it is asked, and the judge notices when it does not.

Held-out scenes (their seeds are no training seed) are edited and drawn with the generation
config's settings; each output must pass the semantic judge and come within 20 dB PSNR of the exact
target. Then bugs that keep every path consistent with the others but wrong (the CFG sign flipped,
another row's K/V reused, the conditioning image dropped, another instruction's tokens) must fail.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from components.data import sample
from components.engine.resolve import DEMO_DIR
from components.evaluate import judge

pytestmark = [pytest.mark.skipif(not (DEMO_DIR / "config.json").is_file(), reason="the demo checkpoint is not installed"),
              pytest.mark.slow]

MIN_PSNR = 20.0


@pytest.fixture(scope="module")
def engine():
    from components.engine.engine import Engine

    return Engine.load("demo")


def edit_case(kind: str, name: str):
    source, target = sample.edit_example(random.Random(f"test-demo-{name}"), kind)
    return sample.render(source, 256), sample.render(target, 256), sample.KIND_INSTRUCTIONS[kind]


def run_ar(engine, text: str, images: list, seed: int = 3):
    from components.engine.ar import ARRequest

    return engine.generate_ar([ARRequest(f"row-{seed}", text, images, seed=seed)])[0]


def run_dit(engine, ar, images: list, reuse: bool = True):
    from components.engine.dit import DiTRequest

    return engine.dit(DiTRequest(ar, images, prompt_kv=ar.prompt_kv if reuse else None)).image


def good(verdict: judge.Verdict) -> bool:
    return verdict.passed and verdict.psnr >= MIN_PSNR


@pytest.fixture(scope="module")
def purple(engine):
    """The reference edit the planted bugs below break: make the sky purple."""
    source, target, text = edit_case("sky_purple", "purple")
    return source, target, text, run_ar(engine, text, [source])


def test_edits_pass_the_judge(engine, purple):
    source, target, text, ar = purple
    assert "purple" in ar.cot_text  # the CoT names the edit
    verdict = judge.judge_edit(run_dit(engine, ar, [source]), source, target, text)
    assert good(verdict), verdict
    source, target, text = edit_case("snow", "snow")
    verdict = judge.judge_edit(run_dit(engine, run_ar(engine, text, [source]), [source]), source, target, text)
    assert good(verdict), verdict


@pytest.fixture(scope="module")
def caption_row(engine):
    scene = sample.random_caption_scene(random.Random("test-demo-caption"))
    return scene, run_ar(engine, sample.caption(scene), [])


def test_caption_passes_the_judge(engine, caption_row):
    scene, ar = caption_row
    verdict = judge.judge_generate(run_dit(engine, ar, []), sample.render(scene, 256), scene)
    assert verdict.passed, verdict


def test_cfg_sign_flipped_fails(engine, caption_row, monkeypatch):
    """On a caption: an edit's unconditional row is as long as its conditional one, and the <cfg> span
    lengths tell the demo model which of the ten instructions it was, so its uncond prediction is
    close to the cond one there; a caption's colours are not in its length."""
    from components.engine.dit import DiTGenerator

    guided = DiTGenerator.guided
    monkeypatch.setattr(DiTGenerator, "guided",
                        lambda self, hidden, *a, **k: guided(self, hidden.flip(0), *a, **k))  # cond + g (uncond - cond)
    scene, ar = caption_row
    verdict = judge.judge_generate(run_dit(engine, ar, []), sample.render(scene, 256), scene)
    assert not verdict.passed, verdict


def test_another_rows_kv_fails(engine, purple, monkeypatch):
    from components.engine.dit import DiTGenerator

    source, target, text, ar = purple
    other_source, _, _ = edit_case("sky_purple", "purple-other")  # same instruction, another scene
    other = run_ar(engine, text, [other_source])
    monkeypatch.setattr(DiTGenerator, "check_kv", lambda self, kv, seq: "")  # the checks that would catch it
    wrong = dataclasses.replace(ar, prompt_kv=other.prompt_kv)
    assert not good(judge.judge_edit(run_dit(engine, wrong, [source]), source, target, text))


def test_conditioning_image_dropped_fails(engine, purple, monkeypatch):
    import components.engine.dit as dit

    encode = dit.encode_cond_images

    def dropped(*args, **kwargs):
        encoded = encode(*args, **kwargs)
        for image in encoded:
            image.latents.zero_()
            image.vit_tokens.zero_()
        return encoded

    monkeypatch.setattr(dit, "encode_cond_images", dropped)
    source, target, text, ar = purple
    assert not good(judge.judge_edit(run_dit(engine, ar, [source], reuse=False), source, target, text))


def test_wrong_instruction_tokens_fail(engine, purple):
    source, target, text, ar = purple
    think, recaption = sample.chain_of_thought("snow", sample.Scene())  # another row's instruction and CoT
    wrong = dataclasses.replace(ar, user_text=sample.KIND_INSTRUCTIONS["snow"], prompt_kv=None,
                                cot_text=f"<think>{think}</think><recaption>{recaption}</recaption>")
    assert not good(judge.judge_edit(run_dit(engine, wrong, [source], reuse=False), source, target, text))


def test_demo_resolves_to_the_installed_checkpoint():
    from components.engine.resolve import resolve_model

    ref = resolve_model("demo")
    assert (ref.kind, ref.path, ref.name) == ("dir", DEMO_DIR, "demo")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "system_prompt.py", "train_meta.json"):
        assert (DEMO_DIR / name).is_file(), name
    size = sum(f.stat().st_size for f in DEMO_DIR.iterdir())
    assert size <= 50 * 2**20, f"{size / 2**20:.1f} MiB"
