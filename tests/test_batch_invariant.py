"""`--batch-invariant` (kernel setting batch_invariant=on): a row's AR output (CoT tokens, exported
K/V) is bitwise the same whatever rows share its batch; the AR step records the setting, and a run
resumed with the other setting is refused. Tiny model, CPU, float32 and bfloat16.

The rows go through the AR scheduler, which prefills every row alone and writes its decoded tokens'
K/V again by a prefill of the row alone before the export (ar.PREFILL_DECODED_KV); so that the
exported K/V show what the decode steps computed, these tests export the decode steps' own K/V.

Negative control: without the setting the target shares its decode steps with the rows beside it
(with it, every decode step is one row's). The old static batch, which padded rows to the longest,
changed the row's K/V bits with its batch; under the scheduler (rows prefilled alone, a static-shape
decode step) this CPU gave the same bits either way in most runs, so the control checks how the
row ran, not its bits. The CoT tokens of this short tiny-model run agree either way.
"""

from __future__ import annotations

import pytest
import torch

from components.engine import ARRequest, Engine, SamplingParams, kernels

from .step_config import step_config
from .test_engine_helpers import keep_cot_in_tokenizer, random_image

SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=12)


def _batches() -> tuple[list[ARRequest], list[ARRequest]]:
    """The same target row among other neighbours, at another index, with other padded lengths."""
    target = ARRequest("target", "a red fox in the snow, photographed at dawn", [], bot_task="think_recaption", seed=5)
    a = [target, ARRequest("n1", "a cat", [], bot_task="think_recaption", seed=1),
         ARRequest("n2", "a watercolor painting of a golden horse near a river at sunset, with soft light and "
                   "long shadows over the hills", [], bot_task="think_recaption", seed=2)]
    b = [ARRequest("m0", "a dog", [], bot_task="think_recaption", seed=4), target,
         ARRequest("m1", "make the sky purple", [random_image(160, 96, seed=1)], bot_task="think_recaption", seed=3)]
    return a, b


def _target_in_both(engine: Engine, mode: str, monkeypatch):
    from components.engine import ar as ar_module

    monkeypatch.setattr(ar_module, "PREFILL_DECODED_KV", False)  # export the decode steps' own K/V
    previous = kernels.configure(batch_invariant=mode)
    try:
        a, b = _batches()
        out_a, out_b = engine.generate_ar(a, SAMPLED)[0], engine.generate_ar(b, SAMPLED)[1]
    finally:
        kernels.configure(previous)
    assert out_a.id == out_b.id == "target"
    return out_a, out_b


def _kv_tensors(out) -> list[torch.Tensor]:
    return out.prompt_kv.keys + out.prompt_kv.values


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request):
    return Engine.load("tiny", seed=0, dtype=request.param)


def test_row_is_bitwise_independent_of_its_batch(engine, monkeypatch):
    out_a, out_b = _target_in_both(engine, "on", monkeypatch)
    assert out_a.prompt_ids == out_b.prompt_ids
    assert out_a.generated_ids == out_b.generated_ids and out_a.cot_text == out_b.cot_text
    assert out_a.ratio_index == out_b.ratio_index
    assert out_a.timings["ar_batch_size"] == out_b.timings["ar_batch_size"] == 1
    ka, kb = _kv_tensors(out_a), _kv_tensors(out_b)
    assert len(ka) == len(kb) > 0 and ka[0].dtype == engine.model.dtype
    for x, y in zip(ka, kb):
        assert torch.equal(x, y)
    assert ka[0].abs().max() > 0.1  # real data


def test_without_the_mode_rows_share_decode_steps(engine, monkeypatch):
    """Negative control (see the module docstring): without the mode the target shares its decode
    steps with its neighbours, and its K/V stay within rounding of the other batch's."""
    keep_cot_in_tokenizer(engine, monkeypatch)  # the decoded tokens' K/V stay in the exported K/V
    out_a, out_b = _target_in_both(engine, "off", monkeypatch)
    assert out_a.prompt_ids == out_b.prompt_ids
    assert out_a.timings["ar_batch_size"] > 1 and out_b.timings["ar_batch_size"] > 1  # decode steps shared
    ka, kb = _kv_tensors(out_a), _kv_tensors(out_b)
    assert all(x.shape == y.shape for x, y in zip(ka, kb))
    # at most the last bits apart: the rows are the same computation
    tol = 1e-5 if ka[0].dtype == torch.float32 else 5e-2
    assert max((x.float() - y.float()).abs().max().item() for x, y in zip(ka, kb)) <= tol


# --------------------------------------------------------------------------- the AR step option
def test_ar_step_records_the_setting_and_refuses_another_on_resume(tmp_path):
    from components.ar.run import run as run_ar
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from components.errors import ConfigError
    from components.shard.run import run as run_shard

    dataset = write_sample_edit_dataset(str(tmp_path / "edit.parquet"), n=2, size=64)
    output = str(tmp_path / "out")
    run_shard(dataset, output, "bi", 1, "edit")
    before = kernels.settings()
    result = run_ar(step_config(output, "bi", batch_size=2, max_new_tokens=3, batch_invariant=True, kv_reuse=False), 0)
    assert result["batch_invariant"] is True and result["rows"] == 2 and result["errors"] == 0
    assert kernels.settings() == before  # the step's setting does not leak into the process
    layout = RunLayout.open(output, "bi")
    assert layout.read_json(layout.settings_key("ar"))["batch_invariant"] is True
    with pytest.raises(ConfigError, match=r"batch_invariant True \(now False\)"):
        run_ar(step_config(output, "bi", batch_size=2, max_new_tokens=3, kv_reuse=False), 0)


def test_step_program_and_cli_pass_the_flag(monkeypatch, tmp_path):
    import components.ar.__main__ as ar_main
    import pipeline.local as local

    seen = {}
    monkeypatch.setattr(ar_main, "run_step", lambda target, kwargs, progress, **kw: seen.update(kwargs) or {})
    assert ar_main.main(["--output", str(tmp_path), "--run-id", "r", "--shard", "0", "--batch-invariant"]) == 0
    assert seen["config"].batch_invariant is True
    seen.clear()
    assert ar_main.main(["--output", str(tmp_path), "--run-id", "r", "--shard", "0"]) == 0
    assert seen["config"].batch_invariant is False

    from pipeline.cli import main as ardit

    jobs = []
    monkeypatch.setattr(local, "run_job", lambda config, **kw: jobs.append(config) or {"rows_total": 0})
    ardit(["generate", str(tmp_path / "x.parquet"), "-o", str(tmp_path), "--batch-invariant"])
    ardit(["generate", str(tmp_path / "x.parquet"), "-o", str(tmp_path)])
    assert [j.batch_invariant for j in jobs] == [True, False]
