"""The AR scheduler's decisions without a model (engine/ar_scheduler.py, BatchPolicy): how many rows
fit the row cap and the K/V budget, a pool's size, its row groups and the slot a joining row takes,
what a failed step does and what an OOM leaves for a resume."""

from __future__ import annotations

from components.engine.ar_scheduler import BatchPolicy
from components.engine.kernels.decode import SPAN_STEP


def _policy(row_cap=None, kv_budget=None, group_count=1) -> BatchPolicy:
    return BatchPolicy(row_cap, kv_budget, bytes_per_token=10, budget_tokens=16, group_count=group_count)


def test_a_slot_is_the_row_s_need_rounded_up_to_the_decode_span():
    policy = _policy()
    assert policy.need(100) == 116
    assert [policy.capacity_for(n) for n in (1, SPAN_STEP, SPAN_STEP + 1)] == [SPAN_STEP, SPAN_STEP, 2 * SPAN_STEP]


def test_rows_that_fit_take_the_smaller_of_the_cap_and_the_budget():
    slot = 10 * SPAN_STEP  # bytes of one slot of SPAN_STEP tokens
    assert _policy(kv_budget=3 * slot + 9).rows_that_fit(SPAN_STEP) == 3
    assert _policy(row_cap=2, kv_budget=3 * slot).rows_that_fit(SPAN_STEP) == 2
    assert _policy(row_cap=5).rows_that_fit(2 * SPAN_STEP) == 5
    assert _policy(kv_budget=slot - 1).rows_that_fit(SPAN_STEP) == 0  # not even one: the row fails as too large
    # a pool: no more slots than rows left to run, and one to try even when the budget says none
    assert _policy(row_cap=8).pool_rows(SPAN_STEP, rows_left=3) == 3
    assert _policy(kv_budget=slot - 1).pool_rows(SPAN_STEP, rows_left=3) == 1


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


def test_an_oom_halves_the_cap_and_the_budget_and_says_what_to_keep():
    policy = _policy(row_cap=8, kv_budget=1000)
    assert policy.halve(rows_in_flight=6, pool_rows=8) == (3, 500)
    assert (policy.row_cap, policy.kv_budget) == (3, 500)
    assert _policy(row_cap=4).halve(rows_in_flight=4, pool_rows=2) == (1, None)  # the pool was smaller
    assert _policy(row_cap=1).halve(rows_in_flight=1, pool_rows=1) is None  # nothing got smaller


def test_what_the_rows_of_a_failed_step_do():
    assert BatchPolicy.after_failure(rows=3, pool_rows=4, out_of_memory=True, solo=False) == "halve"
    assert BatchPolicy.after_failure(rows=3, pool_rows=4, out_of_memory=False, solo=False) == "alone"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=True, solo=False) == "halve"
    assert BatchPolicy.after_failure(rows=1, pool_rows=1, out_of_memory=True, solo=False) == "fail"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=True, solo=True) == "fail"
    assert BatchPolicy.after_failure(rows=1, pool_rows=4, out_of_memory=False, solo=False) == "fail"
