"""The AR scheduler's decisions, apart from the model: what one step of the continuous-batching loop
does (engine/ar_scheduler.py runs it), decided from the scheduler's state as plain data, so that it
is tested without a model (tests/test_ar_policy.py). Nothing here touches torch.

`BatchPolicy` holds the sizing (the `--batch-size` cap, the K/V budget, a slot's capacity, a pool's
rows and row groups, the slot a joining row takes, what a failed step does, the OOM halving) and
plans a step (`plan`): from a `StepState` it returns a `StepPlan`:

    admit  the first waiting rows, in order: each takes a slot, or fails as too large
    ask    what the runner must find out about the first row still waiting once `admit` is done,
           before admission can go on: GATE (the admission gate's answer for it), PREPARE (its
           prompt, so its need: a model call) or GROW (a new pool of `grow_pool_to` tokens a slot:
           an allocation that may run out of memory). The runner finds out, then asks again with the
           answer in the state; the gate is asked, a row prepared, a pool allocated exactly where
           the loop reaches them, one at a time.
    turns  once admission is done (`ask` None): each row group's turn, in order: one prefill chunk
           (of the oldest row whose prompt is not all in its slot) and the group's decode step

The decode step's rows (those decoding in the group when its turn comes, their tokens) depend on the
logits, so they are the runner's; the turns fix which group goes when.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

GATE, PREPARE, GROW = "gate", "prepare", "grow"


class Row(Protocol):
    """A row as the policy sees it (the scheduler's `_Seq`)."""

    @property
    def solo(self) -> bool: ...  # failed in a batch: runs alone, so that a bad row names itself

    @property
    def need(self) -> int | None: ...  # cache tokens it needs (BatchPolicy.need); None until prepared

    @property
    def length(self) -> int: ...  # tokens of its prompt already in its slot

    @property
    def prompt_len(self) -> int: ...  # (a prepared row's)

    @property
    def block_ids(self) -> Sequence[int]: ...  # each prompt token's image block (-1: text); a prepared row's


@dataclass(frozen=True)
class StepState:
    """What the policy decides a step from (references to the scheduler's queues: read, never changed)."""

    waiting: Iterable[Row]  # waiting rows, in order (only those up to the first that stops admission are read)
    slots: Mapping[int, Row]  # the rows in flight, by slot
    prefilling: Sequence[Row]  # the rows in flight whose prompt is not all in their slot, oldest first
    groups: Sequence[tuple[int, int]]  # the pool's row groups [lo, hi) (none before the first pool)
    pool_capacity: int | None  # a slot's tokens (None: no pool)
    chunk_tokens: int  # a prefill chunk's tokens at most (--max-num-batched-tokens)
    gated: bool = False  # an admission gate is asked before each row is admitted
    gate_says: bool | None = None  # its answer for the first waiting row (None: not asked yet)


@dataclass(frozen=True)
class Admit:
    """A waiting row taken out of the queue: into `slot`, or (slot None) failed as too large for
    `capacity` tokens even alone."""

    row: Row
    slot: int | None
    capacity: int


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, end) of `row` into its slot."""

    row: Row
    start: int
    end: int


@dataclass(frozen=True)
class Turn:
    """A row group's turn: a prefill chunk (None: no prompt left to prefill), then the group's decode step."""

    chunk: Chunk | None
    group: tuple[int, int]


@dataclass(frozen=True)
class StepPlan:
    """What the step does next (module docstring): the rows taken, then either a question for the
    runner (`ask`) or, admission done, the row groups' turns."""

    admit: tuple[Admit, ...] = ()
    ask: str | None = None  # GATE, PREPARE or GROW (module docstring); None: admission is done
    grow_pool_to: int | None = None  # with GROW: the new pool's slot capacity (the row then takes slot 0)
    held_idle: bool = False  # the gate holds the first waiting row back with nothing in flight: do not spin
    turns: tuple[Turn, ...] = ()  # with `ask` None


@dataclass
class BatchPolicy:
    """The scheduler's decisions (module docstring). Its cap and budget change only by `halve`."""

    row_cap: int | None  # rows in flight at most (None: the K/V budget decides)
    kv_budget: int | None  # K/V bytes on this rank (None: no byte limit)
    bytes_per_token: int  # K and V of one token on this rank (ar_scheduler.kv_bytes_per_token)
    budget_tokens: int  # a row's cache past its prompt: the CoT budget + ar_scheduler.CLOSING_MARGIN
    span: int  # slot capacities are multiples of the decode kernel's span (kernels/decode.py SPAN_STEP)
    group_count: int = 1  # row groups that decode in turn (one per pipeline stage)

    # -- sizing -----------------------------------------------------------------------------------
    def need(self, prompt_tokens: int) -> int:
        """Cache tokens a row of this prompt needs."""
        return prompt_tokens + self.budget_tokens

    def capacity_for(self, need: int) -> int:
        """A slot's tokens for a row that needs `need`: rounded up to the decode span."""
        return -(-need // self.span) * self.span

    def row_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def rows_that_fit(self, capacity: int) -> int:
        """Slots of `capacity` tokens within the row cap and the K/V budget (0: not even one)."""
        rows = self.row_cap if self.row_cap is not None else 1 << 30
        if self.kv_budget is not None:
            rows = min(rows, self.kv_budget // self.row_bytes(capacity))
        return rows

    def pool_rows(self, capacity: int, rows_left: int) -> int:
        """Slots of a new pool: as many as fit and as rows are left to run, at least one."""
        return max(1, min(self.rows_that_fit(capacity), rows_left))

    def groups(self, pool_rows: int) -> list[tuple[int, int]]:
        """The pool's row groups [lo, hi), as even as the rows allow."""
        bounds = [g * pool_rows // self.group_count for g in range(self.group_count + 1)]
        return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    @staticmethod
    def free_slot(groups: Sequence[tuple[int, int]], used: Iterable[int]) -> int | None:
        """The lowest free slot of the group with the fewest rows in use (so the groups stay even);
        None when every slot is in use."""
        used = set(used)
        best = None
        for lo, hi in groups:
            free = [i for i in range(lo, hi) if i not in used]
            if free and (best is None or hi - lo - len(free) < best[0]):
                best = (hi - lo - len(free), free[0])
        return None if best is None else best[1]

    @staticmethod
    def chunk_end(block_ids: Sequence[int], prompt_len: int, start: int, limit: int) -> int:
        """The end of a prefill chunk from `start`: at most `limit` tokens, extended to the end of an
        image block it would split (its tokens attend to each other both ways)."""
        end = min(prompt_len, start + max(1, limit))
        while end < prompt_len and block_ids[end - 1] >= 0 and block_ids[end] == block_ids[end - 1]:
            end += 1
        return end

    # -- failures ---------------------------------------------------------------------------------
    def halve(self, rows_in_flight: int, pool_rows: int) -> tuple[int, int | None] | None:
        """After an OOM: the row cap becomes half the rows that were in flight, the K/V budget half.
        The (cap, budget) to keep for a resume, or None when neither got smaller (one row, no budget)."""
        rows = min(rows_in_flight, pool_rows)
        self.row_cap = max(1, rows // 2)
        if self.kv_budget is not None:
            self.kv_budget //= 2
        if self.row_cap < rows or self.kv_budget is not None:
            return self.row_cap, self.kv_budget
        return None

    @staticmethod
    def after_failure(rows: int, pool_rows: int, out_of_memory: bool, solo: bool) -> str:
        """What the rows of a failed step do: "fail" (a single row that ran alone, in a pool of one
        slot, or failed for another reason than memory: its error is its own), "halve" (out of
        memory: back to waiting under half the cap) or "alone" (another error: each row again alone,
        so that the bad one names itself)."""
        if rows == 1 and (solo or pool_rows <= 1 or not out_of_memory):
            return "fail"
        return "halve" if out_of_memory else "alone"

    # -- a step -----------------------------------------------------------------------------------
    def plan(self, state: StepState) -> StepPlan:
        """What the step does next (module docstring): the rows it admits, then either what the
        runner must find out before admission goes on, or the row groups' turns."""
        admit, ask, grow_to, idle = self._admission(state)
        if ask is not None:
            return StepPlan(tuple(admit), ask, grow_to)
        placed = [a.row for a in admit if a.slot is not None]
        return StepPlan(tuple(admit), held_idle=idle, turns=self._turns(state, placed))

    def _admission(self, state: StepState) -> tuple[list[Admit], str | None, int | None, bool]:
        """Waiting rows in order, each taken while the batch has room for it: (the rows taken, what
        to find out before going on, a new pool's capacity with GROW, whether the gate holds the
        AR back with nothing in flight)."""
        admit: list[Admit] = []
        used = set(state.slots)
        solo = any(row.solo for row in state.slots.values())
        for row in state.waiting:
            if solo or (row.solo and used):
                break  # a row retried alone waits for an empty batch, and then runs with no other
            if state.gated:
                if admit or state.gate_says is None:
                    return admit, GATE, None, False  # asked once the rows before it are in
                if not state.gate_says:
                    return admit, None, None, not used  # held back: the rows downstream catch up first
            if row.need is None:
                return admit, PREPARE, None, False
            capacity = self.capacity_for(row.need)
            if self.rows_that_fit(capacity) < 1:
                admit.append(Admit(row, None, capacity))
                continue
            if state.pool_capacity is None or capacity > state.pool_capacity:
                if used:
                    break  # a longer row: the pool grows once the rows in flight have left
                return admit, GROW, capacity, False
            slot = self.free_slot(state.groups, used)
            if slot is None:
                break
            admit.append(Admit(row, slot, capacity))
            used.add(slot)
            solo = row.solo
        return admit, None, None, False

    def _turns(self, state: StepState, placed: list[Row]) -> tuple[Turn, ...]:
        """Each row group's turn (one turn without a pool): a chunk of the oldest row whose prompt is
        not all in its slot (the rows just placed last, from their first token), then the group's
        decode step. Under pipeline stages a chunk in every group's turn keeps a chunk in each stage,
        as the groups' steps are."""
        pending = [(row, row.length) for row in state.prefilling] + [(row, 0) for row in placed]
        turns = []
        for group in state.groups or [(0, 0)]:
            chunk = None
            if pending:
                row, start = pending[0]
                end = self.chunk_end(row.block_ids, row.prompt_len, start, state.chunk_tokens)
                chunk = Chunk(row, start, end)
                if end == row.prompt_len:
                    pending.pop(0)
                else:
                    pending[0] = (row, end)
            turns.append(Turn(chunk, tuple(group)))
        return tuple(turns)
