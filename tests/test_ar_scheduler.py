"""Continuous batching in the AR stage (engine/ar_scheduler.py): rows joining and leaving mid-decode
get the tokens (and, with --batch-invariant, the bitwise K/V) they get alone; chunked prefill equals
one prefill; an OOM halves the batch and loses no row; a row that cannot fit alone fails naming its
size; a resume retries transient AR errors but not bad input. Tiny model, CPU, float32."""

from __future__ import annotations

import pytest
import torch

from components.engine import ARRequest, SamplingParams, kernels
from components.engine import ar_scheduler
from components.engine.ar import ARGenerator, ForcedCot
from components.engine.ar_scheduler import Admission, RowTooLarge

from .step_config import step_config
from .test_engine_helpers import random_image, tiny_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=16)
CHUNK = 48  # prefill tokens per step: an edit row's prompt takes several steps
IMG = random_image(160, 96, seed=1)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture
def forced(engine):
    """CoT lengths 3..14 per row (ForcedCot), so rows leave at different steps."""
    engine.ar.forced_cot = ForcedCot(FORCED)
    yield
    engine.ar.forced_cot = None


FORCED = "lognormal:7:3:14"


def _requests(n: int = 5) -> list[ARRequest]:
    prompts = ["a cat", "a watercolor painting of a golden horse near a river at sunset", "a red fox in the snow",
               "a lighthouse at night", "two birds on a wire", "a bowl of fruit"]
    return [ARRequest(f"r{i}", prompts[i % len(prompts)] if i % 3 else "make the sky purple",
                      [IMG] if i % 3 == 0 else [], bot_task="think_recaption", seed=10 + i) for i in range(n)]


def _stream(engine, requests, sampling, admission) -> tuple[dict, dict]:
    results: dict = {}
    stats = engine.ar.stream(requests, lambda req, out: results.__setitem__(req.id, out), sampling,
                             admission=admission)
    return results, stats


def _alone(engine, request, sampling):
    results, _ = _stream(engine, [request], sampling, Admission(max_rows=1, max_num_batched_tokens=CHUNK))
    return results[request.id]


@pytest.fixture(scope="module")
def greedy_alone(engine) -> dict:
    """Each row of _requests() run alone, greedy, with forced CoT lengths."""
    engine.ar.forced_cot = ForcedCot(FORCED)
    try:
        return {r.id: _alone(engine, r, GREEDY) for r in _requests()}
    finally:
        engine.ar.forced_cot = None


def _kv(out) -> list[torch.Tensor]:
    return out.prompt_kv.keys + out.prompt_kv.values


@pytest.mark.slow
def test_rows_joining_and_leaving_get_the_tokens_they_get_alone(engine, forced, greedy_alone):
    reqs = _requests()
    results, stats = _stream(engine, reqs, GREEDY, Admission(max_rows=2, max_num_batched_tokens=CHUNK))
    lengths = {len(out.generated_ids) for out in results.values()}
    assert len(lengths) >= 3  # rows really leave at different steps
    assert stats["pool_rows"] == 2 and stats["rows"] == 5 and stats["mean_batch"] > 1.3  # more rows than slots
    assert stats["prefill_chunks"] > 5  # long prompts were chunked between decode steps
    for req in reqs:
        assert results[req.id].generated_ids == greedy_alone[req.id].generated_ids, req.id
        assert results[req.id].cot_text == greedy_alone[req.id].cot_text


@pytest.mark.slow
def test_batch_invariant_rows_are_bitwise_their_alone_selves(engine, forced):
    previous = kernels.configure(batch_invariant="on")
    try:
        reqs = _requests(3)
        results, stats = _stream(engine, reqs, SAMPLED, Admission(max_rows=2, max_num_batched_tokens=CHUNK))
        assert stats["peak_rows"] == 2
        for req in (reqs[0], reqs[2]):  # an edit row and a T2I row that joined mid-decode
            alone = _alone(engine, req, SAMPLED)
            assert results[req.id].generated_ids == alone.generated_ids
            assert all(torch.equal(x, y) for x, y in zip(_kv(results[req.id]), _kv(alone)))
    finally:
        kernels.configure(previous)


@pytest.mark.slow
def test_generate_runs_the_list_as_one_batch_in_request_order(engine, forced, greedy_alone):
    """Engine.generate_ar (tests, benchmarks, tools) is this scheduler with the whole list admitted
    at once: the outputs come in request order, the rows share decode steps, and each row gets the
    tokens it gets alone."""
    reqs = _requests()[::-1]
    outs = engine.generate_ar(reqs, GREEDY)
    assert [o.id for o in outs] == [r.id for r in reqs]
    assert max(o.timings["ar_batch_size"] for o in outs) > 2  # rows decoded together
    assert [o.generated_ids for o in outs] == [greedy_alone[r.id].generated_ids for r in reqs]


@pytest.mark.slow
def test_chunked_prefill_equals_one_prefill(engine):
    req = _requests(1)[0]  # an edit row: image blocks, which a chunk never splits
    whole, s1 = _stream(engine, [req], GREEDY, Admission(max_rows=1, max_num_batched_tokens=100_000))
    chunked, s2 = _stream(engine, [req], GREEDY, Admission(max_rows=1, max_num_batched_tokens=16))
    assert s1["prefill_chunks"] == 1 and s2["prefill_chunks"] >= 3
    a, b = whole[req.id], chunked[req.id]
    assert a.generated_ids == b.generated_ids
    assert max((x - y).abs().max().item() for x, y in zip(_kv(a), _kv(b))) <= 1e-5


@pytest.mark.slow
def test_an_oom_halves_the_batch_and_every_row_completes(engine, forced, monkeypatch, greedy_alone):
    reqs = _requests()
    fired = []

    def oom_at_four(scheduler):  # four rows in flight, some of them decoding
        if len(scheduler.slots) == 4 and scheduler.running and not fired:
            fired.append(len(scheduler.slots))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ar_scheduler, "fault_hook", oom_at_four)
    results, stats = _stream(engine, reqs, GREEDY, Admission(max_rows=4, max_num_batched_tokens=CHUNK))
    assert fired and stats["oom_retries"] == 1 and stats["failed"] == 0
    assert all(not isinstance(r, BaseException) for r in results.values()) and len(results) == 5
    assert {k: v.generated_ids for k, v in results.items()} == {k: v.generated_ids for k, v in greedy_alone.items()}
    assert stats["pool_rows"] == 2  # the cap halved


def _oom_on_first_pool(engine, monkeypatch) -> list:
    """The model's first K/V pool of more than one row runs out of memory (a GPU whose free memory
    was overestimated); the rows of each pool it was asked for are listed."""
    asked, plain = [], engine.model.new_cache

    def new_cache(rows, capacity, *a, **k):
        asked.append(rows)
        if rows > 1 and len(asked) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory allocating the pool (injected)")
        return plain(rows, capacity, *a, **k)

    monkeypatch.setattr(engine.model, "new_cache", new_cache)
    return asked


@pytest.mark.slow
def test_an_oom_allocating_the_pool_halves_it_and_fails_no_row(engine, monkeypatch):
    """It failed the first waiting row as too large before (nothing was in flight to put back)."""
    asked = _oom_on_first_pool(engine, monkeypatch)
    admission = Admission(max_rows=4, max_num_batched_tokens=CHUNK)
    results, stats = _stream(engine, _requests(3), GREEDY, admission)
    assert asked[:2] == [3, 1] and stats["oom_retries"] == 1 and stats["failed"] == 0 and stats["pool_rows"] == 1
    assert len(results) == 3 and not any(isinstance(r, BaseException) for r in results.values()), results
    assert admission.halved_to == (1, None)
    assert "OutOfMemoryError allocating a K/V pool of 3 row(s)" in stats["events"][0]


def test_negative_control_an_oom_that_never_ends_fails_every_row(engine, monkeypatch):
    """The recovery is not unconditional: an OOM before every step (nothing ever fits) fails each
    row alone as too large, naming the OOM; `generate_ar` raises the first row's failure."""
    def boom(scheduler):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ar_scheduler, "fault_hook", boom)
    with pytest.raises(RowTooLarge, match=r"row r0 does not fit alone: .* it ran out of GPU memory alone "
                                          r"\(OutOfMemoryError: CUDA out of memory \(injected\)\)"):
        engine.generate_ar(_requests(2), GREEDY)
    results, stats = _stream(engine, _requests(2), GREEDY, Admission(max_rows=2))
    assert all(isinstance(results[r.id], RowTooLarge) for r in _requests(2)) and stats["failed"] == 2


@pytest.mark.slow
def test_a_row_that_cannot_fit_alone_fails_naming_its_size(engine, forced):
    reqs = _requests(3)  # r0: an edit row (hundreds of prompt tokens); r1, r2: short T2I rows
    per_token = ar_scheduler.kv_bytes_per_token(engine.model)
    budget = 1024 * per_token  # one slot of 1024 tokens: the edit row (prompt + budget > 1024) does not fit
    long = ARRequest("huge", "make it brighter " * 60, [IMG], bot_task="think_recaption", seed=1)
    results, stats = _stream(engine, [long, *reqs[1:]], SamplingParams(temperature=0, max_new_tokens=600),
                             Admission(kv_budget_bytes=budget))
    err = results["huge"]
    assert isinstance(err, RowTooLarge)
    assert "row huge does not fit alone" in str(err) and "prompt tokens + 616 CoT budget" in str(err)
    assert "GiB of K/V" in str(err) and "--tp" in str(err) and "--quantization fp8" in str(err)
    assert not any(isinstance(results[r.id], BaseException) for r in reqs[1:])
    assert stats["failed"] == 1


@pytest.mark.slow
def test_an_oom_with_the_row_alone_fails_only_that_row(engine, forced, monkeypatch):
    reqs = _requests(3)

    def oom_with_r1(scheduler):
        if any(s.request.id == "r1" for s in scheduler.running):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ar_scheduler, "fault_hook", oom_with_r1)
    results, stats = _stream(engine, reqs, GREEDY, Admission(max_rows=2))
    assert isinstance(results["r1"], RowTooLarge) and "ran out of GPU memory alone" in str(results["r1"])
    assert not isinstance(results["r0"], BaseException) and not isinstance(results["r2"], BaseException)


def test_forced_cot_lengths():
    assert ForcedCot("7").length("x") == 7
    f = ForcedCot("lognormal:300:30:1500")
    lengths = [f.length(f"row{i}") for i in range(400)]
    assert all(30 <= n <= 1500 for n in lengths) and lengths == [f.length(f"row{i}") for i in range(400)]
    assert 200 <= sorted(lengths)[200] <= 450  # the median
    for bad in ("lognormal:3:4:5", "x", "lognormal:1:2"):
        with pytest.raises(ValueError, match="ARDIT_BENCH_COT_TOKENS"):
            ForcedCot(bad)


@pytest.mark.slow
def test_forced_cot_sets_each_rows_length(engine, forced):
    results, _ = _stream(engine, _requests(3), SamplingParams(temperature=0, max_new_tokens=100), Admission())
    closing = 7  # </think> <recaption> </recaption> <answer> <boi> <img_size> ratio: a shorter length gets these
    for rid, out in results.items():
        assert len(out.generated_ids) == max(closing, ForcedCot(FORCED).length(rid))
    assert {len(out.generated_ids) for out in results.values()} != {closing}


def test_bench_cot_needs_dummy_weights(monkeypatch):
    from components.errors import ConfigError
    from components.options import check_bench_cot

    monkeypatch.setenv("ARDIT_BENCH_COT_TOKENS", "lognormal:300:30:1500")
    assert check_bench_cot("hunyuan-image-3", None, True).median == 300
    assert check_bench_cot("tiny", None, False) is not None
    with pytest.raises(ConfigError, match="dummy weights only"):
        check_bench_cot("hunyuan-image-3", "/weights", False)
    monkeypatch.setenv("ARDIT_BENCH_COT_TOKENS", "many")
    with pytest.raises(ConfigError, match="expected N or lognormal"):
        check_bench_cot("tiny", None, False)


# --------------------------------------------------------------------------- the AR step and resume
@pytest.mark.slow
def test_resume_retries_a_transient_row_but_not_a_bad_input_row(tmp_path, monkeypatch):
    from components.ar.run import run as run_ar
    from components.data.ar_outputs import read_ar_rows
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from components.dit.run import run as run_dit
    from components.shard.run import run as run_shard

    dataset = write_sample_edit_dataset(str(tmp_path / "edit.parquet"), n=4, size=64)
    output = str(tmp_path / "out")
    run_shard(dataset, output, "rs", 1, "edit")
    layout = RunLayout.open(output, "rs")
    ids = [j.id for j in layout.shard_writer(0).pending()]
    bad, flaky = ids[1], ids[2]
    real_prepare = ARGenerator.prepare_row

    def prepare(self, req, cond=None):
        if req.id == bad:
            raise ValueError(f"request {req.id}: a bad prompt (injected)")
        return real_prepare(self, req, cond)

    def oom_with_flaky(scheduler):
        if any(s.request.id == flaky for s in scheduler.running):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ARGenerator, "prepare_row", prepare)
    monkeypatch.setattr(ar_scheduler, "fault_hook", oom_with_flaky)
    ar_config = step_config(output, "rs", max_new_tokens=4)
    result = run_ar(ar_config, 0)
    assert result["errors"] == 2
    kinds = {i: r["error_kind"] for i, r in read_ar_rows(layout, 0).items()}
    assert kinds[bad] == "input" and kinds[flaky] == "transient"
    with pytest.raises(RuntimeError, match=f"1 row\\(s\\) failed in the AR step for a transient reason.*{flaky}"):
        run_dit(step_config(output, "rs", steps=1), 0)
    assert not layout.is_committed(0)

    monkeypatch.setattr(ar_scheduler, "fault_hook", None)  # the GPU has room again
    seen = []
    real_stream = ARGenerator.stream
    monkeypatch.setattr(ARGenerator, "stream",
                        lambda self, reqs, *a, **k: seen.extend(r.id for r in reqs) or real_stream(self, reqs, *a, **k))
    run_ar(ar_config, 0)
    assert seen == [flaky]  # only the transient row runs again; the bad row stays an error
    run_dit(step_config(output, "rs", steps=1), 0)
    rows = {r["id"]: r for r in layout.read_rows(0).to_pylist()}
    assert layout.is_committed(0) and rows[flaky]["status"] == "ok"
    assert rows[bad]["status"] == "error" and "bad prompt" in rows[bad]["error"]


@pytest.mark.slow
def test_the_run_keeps_the_halved_budget_for_its_next_steps(tmp_path, monkeypatch):
    """Shard 0's AR step halves after an OOM and keeps the budget that worked in the run; shard 1's
    step (a resume would too) starts from it instead of running into the same OOM."""
    from components.ar.run import run as run_ar
    from components.data.ar_outputs import read_ar_rows
    from components.data.runs import RunLayout
    from components.data.sample import write_sample_edit_dataset
    from components.shard.run import run as run_shard
    from components.models import load_engine

    dataset = write_sample_edit_dataset(str(tmp_path / "edit.parquet"), n=4, size=64)
    output = str(tmp_path / "out")
    run_shard(dataset, output, "b", 2, "edit")
    layout = RunLayout.open(output, "b")
    asked = _oom_on_first_pool(load_engine("tiny", None, "cpu", None), monkeypatch)
    run_ar(step_config(output, "b", max_new_tokens=4), 0)
    assert asked[:2] == [2, 1]
    budget = layout.read_json(layout.settings_key("ar_budget"))
    assert budget["max_rows"] == 1 and budget["shard"] == 0 and budget["device"] == "cpu", budget
    run_ar(step_config(output, "b", max_new_tokens=4), 1)
    assert asked[2:] == [1]  # no pool of 2 rows tried again
    record = layout.read_json(layout.step_timing_key(1, "ar"))
    assert record["budget_from_run"] == {"max_rows": 1, "kv_budget_bytes": None}
    assert record["scheduler"]["oom_retries"] == 0 and record["scheduler"]["pool_rows"] == 1
    assert all(r["status"] == "ok" for k in (0, 1) for r in read_ar_rows(layout, k).values())


def test_step_options_are_checked_and_passed(monkeypatch, tmp_path):
    import components.ar.__main__ as ar_main
    from components.errors import ConfigError
    from components.options import check_engine_options

    seen = {}
    monkeypatch.setattr(ar_main, "run_step", lambda target, kwargs, progress, **kw: seen.update(kwargs) or {})
    base = ["--output", str(tmp_path), "--run-id", "r", "--shard", "0"]
    assert ar_main.main(base) == 0
    config = seen["config"]
    assert (config.batch_size, config.gpu_memory_utilization, config.max_num_batched_tokens) == ("auto", 0.9, None)
    assert ar_main.main(base + ["--batch-size", "40", "--gpu-memory-utilization", "0.8",
                                "--max-num-batched-tokens", "512"]) == 0
    config = seen["config"]
    assert (config.batch_size, config.gpu_memory_utilization, config.max_num_batched_tokens) == (40, 0.8, 512)
    for bad in (dict(batch_size="many"), dict(batch_size=0), dict(gpu_memory_utilization=1.5),
                dict(max_num_batched_tokens=0)):
        with pytest.raises(ConfigError, match=r"^--(batch-size|gpu-memory-utilization|max-num-batched-tokens) .*: must be "):
            check_engine_options(**bad)
    check_engine_options(batch_size="auto", gpu_memory_utilization=0.5, max_num_batched_tokens=64)

    import pipeline.local as local
    from pipeline.cli import main as ardit

    jobs = []
    monkeypatch.setattr(local, "run_job", lambda config, **kw: jobs.append(config) or {"rows_total": 0})
    ardit(["generate", str(tmp_path / "x.parquet"), "-o", str(tmp_path)])
    ardit(["generate", str(tmp_path / "x.parquet"), "-o", str(tmp_path), "--batch-size", "12",
           "--gpu-memory-utilization", "0.7", "--max-num-batched-tokens", "4096"])
    assert [(j.batch_size, j.gpu_memory_utilization, j.max_num_batched_tokens) for j in jobs] == \
        [("auto", 0.9, None), (12, 0.7, 4096)]


def test_every_pipeline_stage_sizes_its_pool_for_the_fullest_stage():
    """3 layers over 2 stages (2 + 1): both stages count 2 layers per token, so they admit alike."""
    from components.engine.config import tiny_config
    from components.engine.engine import build_model
    from components.engine.parallel import stage_layers
    from components.runtime.parallel import ParallelContext

    model = build_model(tiny_config().replace(num_hidden_layers=3, moe_topk=[2] * 3, moe_intermediate_size=[64] * 3,
                                              num_shared_expert=[1] * 3), "cpu")
    per_layer = ar_scheduler.kv_bytes_per_token(model) // 3
    for stage in range(2):
        model.parallel = ParallelContext(0, 1, torch.device("cpu"), pp_rank=stage, pp_size=2)
        model.stage_layers = stage_layers(3, 2, stage)
        assert ar_scheduler.kv_bytes_per_token(model) == 2 * per_layer
