"""Metrics with known answers, and run-vs-run comparison on synthetic run directories."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from components.evaluate.__main__ import main as evaluate_main
from components.evaluate.metrics import (
    ERROR_IN_RUN,
    IMAGE_MISSING,
    MISSING_IN_REF,
    MISSING_IN_RUN,
    OK,
    SIZE_MISMATCH,
    ImageMismatchError,
    common_prefix_len,
    compare_images,
    compare_runs,
    first_divergence,
    latent_cosine_distance,
    text_similarity,
)
from tests.fixtures_sweep import fake_rows, scene, to_uint8, write_run


def _gray(h: int = 128, w: int = 160, level: float = 0.5) -> np.ndarray:
    return np.full((h, w, 3), level)


def test_identical_images_are_bitwise_and_infinite_psnr() -> None:
    img = to_uint8(scene(0))
    m = compare_images(img, img.copy())
    assert m["psnr"] == math.inf
    assert m["bitwise"] is True
    assert m["ssim"] == pytest.approx(1.0)
    assert m["mean_abs"] == 0.0 and m["max_abs"] == 0.0 and m["mismatch_any"] == 0.0
    assert (m["width"], m["height"]) == (img.shape[1], img.shape[0])


def test_pil_and_array_inputs_agree() -> None:
    a, b = to_uint8(scene(1)), to_uint8(scene(2))
    m1 = compare_images(a, b)
    m2 = compare_images(Image.fromarray(a), Image.fromarray(b))
    assert m1 == m2
    assert m1["bitwise"] is False


def test_gaussian_noise_psnr_matches_the_analytic_value() -> None:
    sigma = 0.05
    rng = np.random.default_rng(0)
    ref = _gray(256, 256)
    noisy = ref + rng.normal(0, sigma, ref.shape)  # 0.5 +- 5 sigma stays inside [0, 1]
    m = compare_images(ref, noisy)
    assert m["psnr"] == pytest.approx(10 * math.log10(1 / sigma**2), abs=0.1)  # 26.02 dB
    assert m["mse"] == pytest.approx(sigma**2, rel=0.02)
    # |N(0, s)| has mean s*sqrt(2/pi) and median 0.674 s; p99 of |N| is 2.576 s.
    assert m["mean_abs"] == pytest.approx(sigma * math.sqrt(2 / math.pi), rel=0.02)
    assert m["p50_abs"] == pytest.approx(0.6745 * sigma, rel=0.03)
    assert m["p99_abs"] == pytest.approx(2.5758 * sigma, rel=0.03)
    assert m["bitwise"] is False


def test_constant_offset_gives_exact_values() -> None:
    ref = to_uint8(scene(3)).astype(np.int32)
    ref = np.clip(ref, 0, 200)
    other = ref + 4  # every channel value off by exactly 4 levels
    m = compare_images(ref.astype(np.uint8), other.astype(np.uint8))
    assert m["psnr"] == pytest.approx(20 * math.log10(255 / 4), abs=1e-9)
    assert m["mean_abs"] == pytest.approx(4 / 255)
    assert m["p99_abs"] == pytest.approx(4 / 255)
    assert m["max_abs"] == pytest.approx(4 / 255)
    assert m["mismatch_any"] == 1.0
    assert m["mismatch_gt_1"] == 1.0
    assert m["mismatch_gt_4"] == 0.0  # exactly 4/255 is within "> 4/255"
    assert m["mismatch_gt_16"] == 0.0


def test_ssim_orders_by_damage() -> None:
    ref = scene(0, width=128, height=96)
    rng = np.random.default_rng(1)
    ssim = [
        compare_images(ref, np.clip(ref + rng.normal(0, sigma, ref.shape), 0, 1))["ssim"]
        for sigma in (0.005, 0.02, 0.08, 0.3)
    ]
    assert 1.0 > ssim[0] > 0.95
    assert ssim == sorted(ssim, reverse=True)
    assert ssim[-1] < 0.2


def test_tiny_images_still_get_ssim() -> None:
    a = np.random.default_rng(0).random((5, 5, 3))
    assert compare_images(a, a)["ssim"] == pytest.approx(1.0)
    assert math.isnan(compare_images(a[:2, :2], a[:2, :2])["ssim"])


def test_size_mismatch_is_an_error() -> None:
    with pytest.raises(ImageMismatchError, match="size mismatch"):
        compare_images(_gray(64, 64), _gray(64, 65))


def test_float_images_outside_unit_range_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"float images must hold values in \[0, 1\]"):
        compare_images(_gray() * 255, _gray() * 255)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 2, 4], 2),
        ([1, 2], [1, 2, 3], 2),
        ([], [7], 0),
        ([5, 2, 3], [1, 2, 3], 0),
        ([], [], None),
    ],
)
def test_first_divergence(a: list[int], b: list[int], expected: int | None) -> None:
    assert first_divergence(a, b) == expected


def test_text_similarity_and_prefix() -> None:
    assert text_similarity("a red fox", "a red fox") == 1.0
    assert text_similarity("", None) == 1.0
    assert text_similarity("abcd", "abce") == pytest.approx(0.75)  # 2 * 3 matches / 8 chars
    assert text_similarity("abc", "xyz") == 0.0
    assert common_prefix_len("the sky is", "the sea is") == 5


def test_latent_cosine_distance() -> None:
    x = torch.randn(4, 8, 8)
    assert latent_cosine_distance(x, x.clone()) == 0.0
    assert latent_cosine_distance(x, 2 * x) == pytest.approx(0.0, abs=1e-12)
    assert latent_cosine_distance(x, -x) == pytest.approx(2.0)
    assert latent_cosine_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == pytest.approx(1.0)
    assert math.isnan(latent_cosine_distance(x, x[:2]))


def test_compare_runs_matches_rows_and_reports_failures(tmp_path) -> None:
    ref_rows = fake_rows({"seed": 42})
    other = fake_rows({"seed": 42, "kv_reuse": False})
    other[1]["status"], other[1]["error"] = "error", "DiT ran out of memory"
    other[2]["image"] = other[2]["image"][:32]  # wrong height
    other = [r for r in other if r["id"] != "r3"]  # row lost
    other.append({**fake_rows({"seed": 42}, ids=["extra"])[0]})
    write_run(tmp_path, "ref", ref_rows)
    run = write_run(tmp_path, "other", other)
    (run / "shards" / "0" / "images" / "r0.png").unlink()  # r0 lives in shard 0: image gone

    by_id = {r["id"]: r for r in compare_runs(tmp_path / "ref", tmp_path / "other")}
    assert set(by_id) == {"r0", "r1", "r2", "r3", "extra"}
    assert by_id["r0"]["eval_status"] == IMAGE_MISSING
    assert by_id["r1"]["eval_status"] == ERROR_IN_RUN and "out of memory" in by_id["r1"]["eval_error"]
    assert by_id["r2"]["eval_status"] == SIZE_MISMATCH and "size mismatch" in by_id["r2"]["eval_error"]
    assert by_id["r3"]["eval_status"] == MISSING_IN_RUN
    assert by_id["extra"]["eval_status"] == MISSING_IN_REF


def test_compare_runs_ok_rows_carry_all_metrics(tmp_path) -> None:
    write_run(tmp_path, "ref", fake_rows({"seed": 42}))
    write_run(tmp_path, "seed", fake_rows({"seed": 43}))
    rows = compare_runs(tmp_path / "ref", tmp_path / "seed")
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    for r in rows:
        assert r["eval_status"] == OK
        assert r["tokens_identical"] is False
        assert r["first_divergence"] == 5  # the shared prompt prefix of the fake tokens
        assert 0 < r["cot_similarity"] < 1
        assert r["latent_cos_dist"] > 0.1
        assert r["time_per_image_s"] == pytest.approx(0.12 + 0.30 + 0.06 * 8 * 0.8 + 0.05)
        assert np.isfinite(r["psnr"]) and r["psnr"] < 30


def test_rows_with_unsafe_ids_find_their_image_and_latents(tmp_path) -> None:
    ids = ["photo 1/a.jpg", "r1"]
    write_run(tmp_path, "ref", fake_rows({"seed": 42}, ids=ids))
    write_run(tmp_path, "other", fake_rows({"seed": 42, "kv_reuse": False}, ids=ids))
    rows = compare_runs(tmp_path / "ref", tmp_path / "other")
    assert [r["id"] for r in rows] == ids
    assert all(r["eval_status"] == OK and r["latent_cos_dist"] is not None for r in rows)


def test_generated_ids_stored_as_json_text_are_read(tmp_path) -> None:
    write_run(tmp_path, "ref", fake_rows({"seed": 42}), ids_as_json=True)
    write_run(tmp_path, "seed", fake_rows({"seed": 43}), ids_as_json=True)
    rows = compare_runs(tmp_path / "ref", tmp_path / "seed")
    assert [r["first_divergence"] for r in rows] == [5, 5, 5, 5]


def test_evaluate_step_writes_tables_and_gates(tmp_path, capsys) -> None:
    write_run(tmp_path, "ref", fake_rows({"seed": 42}))
    write_run(tmp_path, "recompute", fake_rows({"seed": 42, "kv_reuse": False}))
    write_run(tmp_path, "fewsteps", fake_rows({"seed": 42, "steps": 4}))
    args = ["--output", str(tmp_path), "--ref-run", "ref", "--psnr-min", "30", "--ssim-min", "0.97"]
    assert evaluate_main([*args, "--run", "recompute"]) == 0
    rows = pq.read_table(tmp_path / "recompute" / "metrics.parquet").to_pylist()
    cfg = pq.read_table(tmp_path / "recompute" / "metrics_config.parquet").to_pylist()[0]
    assert len(rows) == 4 and all(r["eval_status"] == OK for r in rows)
    assert cfg["passed"] is True and cfg["rows_compared"] == 4 and cfg["bitwise_rows"] == 0
    assert evaluate_main([*args, "--run", "fewsteps"]) == 1
    assert "PSNR" in capsys.readouterr().err
