"""Continuous batching admits a waiting row as soon as a slot frees, while the other rows decode on
(engine/ar_scheduler.py), rather than waiting for the whole batch to finish as a static batch
would. Observed through the scheduler's per-step hook: which rows wait, which decode. Tiny model,
CPU, greedy, CoT lengths forced per row (ForcedCot) so one row of the first pair leaves early."""

from __future__ import annotations

import pytest

from components.engine import ARRequest, SamplingParams
from components.engine import ar_scheduler
from components.engine.ar import ForcedCot
from components.engine.ar_scheduler import Admission

from .test_engine_helpers import tiny_engine

FORCED = ForcedCot("lognormal:7:3:14")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def test_a_waiting_row_joins_while_another_row_decodes(engine, monkeypatch):
    ids = [f"row{i}" for i in range(40)]
    short, long = min(ids, key=FORCED.length), max(ids, key=FORCED.length)
    assert FORCED.length(long) - FORCED.length(short) >= 4  # `long` decodes on after `short` left
    requests = [ARRequest(short, "a cat", [], bot_task="think_recaption", seed=1),
                ARRequest(long, "a red fox in the snow", [], bot_task="think_recaption", seed=2),
                ARRequest("late", "two birds on a wire", [], bot_task="think_recaption", seed=3)]
    seen: list[tuple[set[str], set[str], set[str]]] = []  # before each step: waiting, decoding, in flight

    def look(s) -> None:
        seen.append(({q.request.id for q in s.waiting}, {q.request.id for q in s.running},
                     {q.request.id for q in s.in_flight}))

    monkeypatch.setattr(ar_scheduler, "fault_hook", look)
    results: dict = {}
    engine.ar.forced_cot = FORCED
    try:
        engine.ar.stream(requests, lambda req, out: results.__setitem__(req.id, out),
                         SamplingParams(temperature=0, max_new_tokens=32), admission=Admission(max_rows=2))
    finally:
        engine.ar.forced_cot = None
    assert sorted(results) == sorted(r.id for r in requests)
    assert not any(isinstance(out, BaseException) for out in results.values()), results
    assert any("late" in waiting and long in decoding for waiting, decoding, _ in seen)  # two slots, both taken
    # ... and `late` was taken in (prefilling or decoding) while `long` still decoded
    assert any("late" in in_flight and long in decoding for _, decoding, in_flight in seen), seen
