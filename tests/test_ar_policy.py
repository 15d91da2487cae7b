"""The AR scheduler's decisions without a model (engine/ar_policy.py, BatchPolicy): how many rows fit
the row cap and the K/V budget, a pool's size, its row groups and the slot a joining row takes, what
a failed step does and what an OOM leaves for a resume; and a step's plan from the scheduler's state
as plain data: the rows admitted (in order, into slots, or failed as too large), what the runner must
find out first (the gate's answer, a row's prompt, a new pool), and each row group's turn (a prefill
chunk within the token limit, then the group's decode step)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from components.engine import ar_policy
from components.engine.ar_policy import GATE, GROW, PREPARE, Admit, BatchPolicy, Chunk, StepState, Turn

SPAN = 64  # the decode span the policy rounds a slot up to (the scheduler gives it kernels/decode.py's)
BUDGET = 16  # a row's cache past its prompt


def _policy(row_cap=None, kv_budget=None, group_count=1) -> BatchPolicy:
    return BatchPolicy(row_cap, kv_budget, bytes_per_token=10, budget_tokens=BUDGET, span=SPAN,
                       group_count=group_count)


@dataclass(eq=False)  # rows are told apart by identity, as the scheduler's are
class Row:
    name: str
    need: int | None = None  # None: not prepared yet
    solo: bool = False
    prompt_len: int = 0
    block_ids: list[int] = field(default_factory=list)
    length: int = 0

    def __repr__(self) -> str:
        return self.name


def _ready(name: str, prompt: int = 20, solo: bool = False, blocks: list[int] | None = None) -> Row:
    """A prepared row of `prompt` text tokens (its slot: one span)."""
    return Row(name, prompt + BUDGET, solo, prompt, blocks if blocks is not None else [-1] * prompt)


def _state(waiting=(), slots=None, prefilling=(), groups=((0, 4),), capacity=SPAN, chunk=1000, gated=False,
           gate_says=None) -> StepState:
    return StepState(list(waiting), dict(slots or {}), list(prefilling), list(groups), capacity, chunk, gated,
                     gate_says)


def _taken(plan) -> list[tuple[str, int | None]]:
    return [(a.row.name, a.slot) for a in plan.admit]


# -- sizing ---------------------------------------------------------------------------------------
def test_a_slot_is_the_row_s_need_rounded_up_to_the_decode_span():
    policy = _policy()
    assert policy.need(100) == 116
    assert [policy.capacity_for(n) for n in (1, SPAN, SPAN + 1)] == [SPAN, SPAN, 2 * SPAN]


def test_rows_that_fit_take_the_smaller_of_the_cap_and_the_budget():
    slot = 10 * SPAN  # bytes of one slot of SPAN tokens
    assert _policy(kv_budget=3 * slot + 9).rows_that_fit(SPAN) == 3
    assert _policy(row_cap=2, kv_budget=3 * slot).rows_that_fit(SPAN) == 2
    assert _policy(row_cap=5).rows_that_fit(2 * SPAN) == 5
    assert _policy(kv_budget=slot - 1).rows_that_fit(SPAN) == 0  # not even one: the row fails as too large
    # a pool: no more slots than rows left to run, and one to try even when the budget says none
    assert _policy(row_cap=8).pool_rows(SPAN, rows_left=3) == 3
    assert _policy(kv_budget=slot - 1).pool_rows(SPAN, rows_left=3) == 1


def test_row_groups_stay_even_and_a_joining_row_takes_the_emptier_group():
    policy = _policy(group_count=2)
    groups = policy.groups(5)
    assert groups == [(0, 2), (2, 5)]
    assert _policy(group_count=3).groups(2) == [(0, 1), (1, 2)]  # fewer slots than groups: no empty group
    slots, used = [], set()
    while (slot := policy.free_slot(groups, used)) is not None:
        slots.append(slot)
        used.add(slot)
    assert slots == [0, 2, 1, 3, 4]  # alternating between the groups while both have room
    assert policy.free_slot(groups, {0, 1, 2}) == 3


# -- failures -------------------------------------------------------------------------------------
def test_an_oom_halves_the_cap_and_the_budget_and_says_what_to_keep():
    policy = _policy(row_cap=8, kv_budget=1000)
    assert policy.halve(rows_in_flight=6, pool_rows=8) == (3, 500)
    assert (policy.row_cap, policy.kv_budget) == (3, 500)
    assert _policy(row_cap=4).halve(rows_in_flight=4, pool_rows=2) == (1, None)  # the pool was smaller
    assert _policy(row_cap=1).halve(rows_in_flight=1, pool_rows=1) is None  # nothing got smaller


def test_after_a_halving_the_next_pool_and_the_too_large_check_use_the_halved_budget():
    slot = 10 * SPAN
    policy = _policy(row_cap=8, kv_budget=4 * slot)
    assert policy.pool_rows(SPAN, rows_left=10) == 4
    policy.halve(rows_in_flight=4, pool_rows=4)
    assert policy.pool_rows(SPAN, rows_left=10) == 2
    policy.halve(rows_in_flight=2, pool_rows=2)
    policy.halve(rows_in_flight=1, pool_rows=1)  # the budget is below one slot now
    plan = policy.plan(_state([_ready("a")], capacity=None, groups=()))
    assert _taken(plan) == [("a", None)] and plan.admit[0].capacity == SPAN  # fails as too large


def test_what_the_rows_of_a_failed_step_do():
    assert BatchPolicy.after_failure(rows=3, pool_rows=4, out_of_memory=True, solo=False) == "halve"
    assert BatchPolicy.after_failure(rows=3, pool_rows=4, out_of_memory=False, solo=False) == "alone"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=True, solo=False) == "halve"
    assert BatchPolicy.after_failure(rows=1, pool_rows=1, out_of_memory=True, solo=False) == "fail"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=True, solo=True) == "fail"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=False, solo=False) == "fail"


# -- a step's plan: admission ---------------------------------------------------------------------
def test_waiting_rows_are_admitted_in_order_into_the_free_slots_until_the_pool_is_full():
    busy = _ready("busy")
    waiting = [_ready(n) for n in "abcd"]
    plan = _policy().plan(_state(waiting, slots={1: busy}))
    assert _taken(plan) == [("a", 0), ("b", 2), ("c", 3)]  # d waits: every slot is taken
    assert plan.ask is None and not plan.held_idle


def test_a_waiting_row_joins_while_another_row_decodes():
    """Continuous batching: a free slot is filled at once, not when the batch has drained."""
    decoding = _ready("decoding")
    decoding.length = decoding.prompt_len  # its prompt is in, it decodes (not in `prefilling`)
    plan = _policy().plan(_state([_ready("late")], slots={0: decoding}, groups=((0, 2),)))
    assert _taken(plan) == [("late", 1)]
    assert plan.turns == (Turn(Chunk(plan.admit[0].row, 0, 20), (0, 2)),)  # and its prefill starts this step


def test_a_row_that_does_not_fit_alone_fails_as_too_large_and_the_next_rows_go_on():
    policy = _policy(kv_budget=10 * 2 * SPAN)  # two slots of one span, one of two spans
    waiting = [_ready("a"), _ready("big", prompt=3 * SPAN), _ready("b")]
    plan = policy.plan(_state(waiting))
    assert _taken(plan) == [("a", 0), ("big", None), ("b", 1)]
    assert plan.admit[1] == Admit(waiting[1], None, 4 * SPAN)


def test_a_longer_row_waits_until_the_pool_is_empty_then_the_pool_grows():
    policy = _policy()
    waiting = [_ready("a"), _ready("long", prompt=2 * SPAN), _ready("b")]
    plan = policy.plan(_state(waiting))
    assert _taken(plan) == [("a", 0)] and plan.ask is None  # long waits for the pool to empty; b keeps its turn
    plan = policy.plan(_state(waiting[1:], slots={3: _ready("x")}))
    assert _taken(plan) == [] and plan.ask is None
    plan = policy.plan(_state(waiting[1:]))  # the pool empty: a new one of the longer row's size
    assert _taken(plan) == [] and (plan.ask, plan.grow_pool_to) == (GROW, 3 * SPAN) and plan.turns == ()
    plan = policy.plan(_state(waiting, capacity=None, groups=()))  # no pool yet: the first row's size
    assert (plan.ask, plan.grow_pool_to) == (GROW, SPAN)


def test_a_row_is_prepared_where_admission_reaches_it():
    waiting = [_ready("a"), Row("raw"), _ready("c")]
    plan = _policy().plan(_state(waiting))
    assert _taken(plan) == [("a", 0)] and plan.ask == PREPARE and plan.turns == ()  # "raw", once a is in


def test_the_gate_is_asked_before_each_row_and_holds_admission():
    waiting = [_ready("a"), _ready("b")]
    policy = _policy()
    plan = policy.plan(_state(waiting, gated=True))
    assert _taken(plan) == [] and plan.ask == GATE  # asked first, before the row is prepared or placed
    plan = policy.plan(_state(waiting, gated=True, gate_says=True))
    assert _taken(plan) == [("a", 0)] and plan.ask == GATE  # the next row asks again, with a in flight
    busy = _ready("busy")
    plan = policy.plan(_state(waiting, slots={0: busy}, gated=True, gate_says=False))
    assert _taken(plan) == [] and plan.ask is None and not plan.held_idle  # held: the rows in flight go on
    assert plan.turns == (Turn(None, (0, 4)),)
    plan = policy.plan(_state(waiting, gated=True, gate_says=False))
    assert _taken(plan) == [] and plan.held_idle  # held with nothing in flight: the runner waits a moment
    plan = policy.plan(_state([Row("raw")], gated=True))
    assert plan.ask == GATE  # the gate before the prompt is prepared


def test_a_row_retried_alone_after_a_failure_runs_with_no_other_row():
    policy = _policy()
    solo = _ready("solo", solo=True)
    assert _taken(policy.plan(_state([solo], slots={2: _ready("x")}))) == []  # waits for an empty batch
    assert _taken(policy.plan(_state([solo, _ready("b")]))) == [("solo", 0)]  # b waits behind it
    assert _taken(policy.plan(_state([_ready("b")], slots={0: solo}))) == []  # nothing joins a solo row


# -- a step's plan: the turns ---------------------------------------------------------------------
def test_one_group_without_stages_and_one_turn_before_any_pool():
    plan = _policy().plan(_state())
    assert plan.turns == (Turn(None, (0, 4)),)
    plan = _policy().plan(_state(capacity=None, groups=()))
    assert plan.turns == (Turn(None, (0, 0)),)


def test_row_groups_under_pipeline_stages_take_turns_each_with_a_chunk():
    policy = _policy(group_count=2)
    groups = policy.groups(4)
    waiting = [_ready(n, prompt=10) for n in "abc"]
    plan = policy.plan(_state(waiting, groups=groups, chunk=100))
    assert _taken(plan) == [("a", 0), ("b", 2), ("c", 1)]  # the groups stay even
    a, b, _ = waiting
    assert plan.turns == (Turn(Chunk(a, 0, 10), (0, 2)), Turn(Chunk(b, 0, 10), (2, 4)))
    plan = policy.plan(_state(waiting, groups=groups, chunk=6))  # a row's chunks follow each other
    assert [t.chunk for t in plan.turns] == [Chunk(a, 0, 6), Chunk(a, 6, 10)]


def test_chunked_prefill_keeps_to_the_token_limit_from_where_a_row_left_off():
    old = _ready("old", prompt=20)
    old.length = 4
    new = _ready("new", prompt=20)
    plan = _policy(group_count=3).plan(_state([new], slots={0: old}, prefilling=[old],
                                              groups=((0, 1), (1, 2), (2, 3)), chunk=7))
    assert _taken(plan) == [("new", 1)]
    assert [t.chunk for t in plan.turns] == [Chunk(old, 4, 11), Chunk(old, 11, 18), Chunk(old, 18, 20)]
    assert all(c.end - c.start <= 7 for c in (t.chunk for t in plan.turns))


def test_chunks_never_split_an_image_block():
    blocks = [-1, -1, 0, 0, 0, 0, -1, 1, 1, -1]
    ends, start = [], 0
    while start < 10:
        start = BatchPolicy.chunk_end(blocks, 10, start, 3)
        ends.append(start)
    assert ends == [6, 9, 10]
    row = _ready("edit", prompt=10, blocks=blocks)
    plan = _policy(group_count=2).plan(_state([row], groups=((0, 1), (1, 2)), chunk=3))
    assert [t.chunk for t in plan.turns] == [Chunk(row, 0, 6), Chunk(row, 6, 9)]


# -- no model -------------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_the_policy_needs_no_model():
    """ar_policy.py imports the standard library only: no torch, nothing of the engine. Control: the
    runner (ar_scheduler.py) imports both."""
    policy = Path(ar_policy.__file__)
    assert _imports(policy) <= {"__future__", "collections", "dataclasses", "typing"}, _imports(policy)
    assert {"torch", "."} <= _imports(policy.with_name("ar_scheduler.py"))
