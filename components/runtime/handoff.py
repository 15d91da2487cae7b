"""Rows handed from the AR step to the DiT step of the same shard inside one model copy, as the AR
finishes them (an overlapped job: components/overlap/run.py).

    AR thread                                   DiT thread
    scheduler admits a row? -- admit(in_flight) --> (held back while the DiT is far behind)
    a row finished, its K/V in the copy's       take() -> the next finished row (its ar.parquet
      in-memory store -------- put(row) ------->          record, with the K/V's key)
    no more rows ------------- finish(error) --> take() -> None once every row is taken
                               <-- cancel() ---- the DiT side stopped: the AR stops at its next admit

`admit` is the AR scheduler's admission gate (ar_scheduler.Admission.gate). It keeps the AR at most
`lead_rows` rows ahead of the DiT (rows in the AR's flight plus rows finished and not yet taken), so
the K/V waiting for the DiT stays bounded. A first wave of `head_rows` gets the DiT going soon; an
AR with nothing in flight waits until the DiT is down to `low_rows` waiting rows and then admits a
whole wave, so its decode steps run at a full batch (a decode step reads every weight whatever its
batch: rows admitted one at a time would cost a step each).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

# rows of the first wave (the DiT waits for its first row), the backlog at which an idle AR starts
# its next wave, and how far it may run ahead
HEAD_ROWS, LOW_ROWS, LEAD_ROWS = 4, 12, 32


class Cancelled(BaseException):
    """The DiT side stopped (it failed, or the job was interrupted): the AR step stops with it. A
    BaseException, so the AR scheduler's recovery (which retries rows after an Exception) lets it
    through."""


class Handoff:
    """One shard's finished AR rows on their way to its DiT, in the order they finished."""

    def __init__(self, head_rows: int = HEAD_ROWS, low_rows: int = LOW_ROWS, lead_rows: int = LEAD_ROWS):
        if not 1 <= head_rows <= lead_rows or not 0 <= low_rows < lead_rows:
            raise ValueError(f"handoff rows: need 1 <= head ({head_rows}) <= lead ({lead_rows}) and "
                             f"0 <= low ({low_rows}) < lead")
        self.head_rows, self.low_rows, self.lead_rows = head_rows, low_rows, lead_rows
        self.rows: deque[dict[str, Any]] = deque()
        self.changed = threading.Condition()
        self.taken = 0
        self.put_count = 0
        self.finished = False
        self.error: BaseException | None = None  # why the AR side stopped early
        self.cancelled = False
        self.held_s = 0.0  # the AR's time held back at the gate with nothing in flight
        self.waited_s = 0.0  # the DiT's time waiting for a row
        self.reserve_bytes = 0  # GPU memory the AR leaves the DiT beside it (overlap.dit_reserve_bytes)
        # the AR's K/V budget, when an earlier shard's AR of the same copy measured it (a chained
        # shard: measured now, the GPU memory the previous shard's DiT holds would count twice,
        # once in use and once in reserve_bytes); None: the AR measures it
        self.kv_budget_bytes: int | None = None

    # -- the AR side ------------------------------------------------------------------------------
    def admit(self, in_flight: int) -> bool:
        """Whether the AR may admit one more row now, given its rows in flight. With none in flight
        it waits until it may (the DiT catches up), so the AR loop never spins."""
        with self.changed:
            t0 = time.perf_counter()
            while True:
                if self.cancelled:
                    raise Cancelled("the DiT side stopped")
                if self._room(in_flight):
                    break
                if in_flight:
                    return False
                self.changed.wait(0.5)
            if not in_flight:
                self.held_s += time.perf_counter() - t0
            return True

    def _room(self, in_flight: int) -> bool:
        waiting = len(self.rows)
        if self.taken == 0 and waiting == 0:  # the first wave: get the DiT going
            return in_flight < self.head_rows
        if waiting + in_flight >= self.lead_rows:
            return False
        return in_flight > 0 or waiting <= self.low_rows

    def put(self, row: dict[str, Any]) -> None:
        """A row the AR finished (ok or error): its ar.parquet record, K/V key included. Raises
        Cancelled once the DiT side stopped (the AR stops at its next finished row)."""
        with self.changed:
            if self.cancelled:
                raise Cancelled("the DiT side stopped")
            self.rows.append(row)
            self.put_count += 1
            self.changed.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """The AR side is done (`error`: why it stopped before every row): take() returns None
        once the rows put so far are taken."""
        with self.changed:
            self.finished, self.error = True, error
            self.changed.notify_all()

    # -- the DiT side -----------------------------------------------------------------------------
    def take(self) -> dict[str, Any] | None:
        """The next finished row, waiting for one; None when the AR side is done and every row it
        put has been taken."""
        with self.changed:
            t0 = time.perf_counter()
            while not self.rows and not self.finished:
                self.changed.wait(0.5)
            self.waited_s += time.perf_counter() - t0
            if not self.rows:
                return None
            self.taken += 1
            self.changed.notify_all()  # room for the AR
            return self.rows.popleft()

    def cancel(self) -> None:
        """Stop the AR side (at its next admission) and let nothing wait on it any more."""
        with self.changed:
            self.cancelled = True
            self.changed.notify_all()

    def stats(self) -> dict[str, Any]:
        return {"rows": self.put_count, "dit_waited_s": round(self.waited_s, 3), "ar_held_s": round(self.held_s, 3),
                "head_rows": self.head_rows, "low_rows": self.low_rows, "lead_rows": self.lead_rows}
