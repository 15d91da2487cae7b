"""docs/sweeps.md documents every key a spec accepts, and says which parameters are grid axes."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from components.evaluate.gates import VERDICTS, Thresholds
from components.sweep.params import GRID_PARAMS, JOB_PARAMS
from components.sweep.spec import (
    BUDGET_KEYS,
    EXTRA_CONFIG_KEYS,
    OVERRIDE_KEYS,
    SAMPLE_DATASET_KEYS,
    TIMING_KEYS,
    TOP_LEVEL_KEYS,
)

DOC = (Path(__file__).resolve().parents[1] / "docs" / "sweeps.md").read_text()


def _table_rows(heading: str) -> dict[str, list[str]]:
    """First-column key -> the other cells, for the first table after `heading`."""
    section = DOC.split(heading, 1)[1]
    rows = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        m = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        if m:
            rows[m.group(1)] = cells[1:]
    return rows


KEYS = (*TOP_LEVEL_KEYS, *JOB_PARAMS, *BUDGET_KEYS, *TIMING_KEYS, *SAMPLE_DATASET_KEYS, *OVERRIDE_KEYS,
        *EXTRA_CONFIG_KEYS, *(f.name for f in fields(Thresholds)))  # fmt: skip


def _undocumented(doc: str) -> list[str]:
    return [k for k in KEYS if f"`{k}`" not in doc and f"{k}:" not in doc]


def test_every_spec_key_is_documented() -> None:
    assert _undocumented(DOC) == []


def test_tables_match_the_code() -> None:
    assert set(_table_rows("### Top level")) == set(TOP_LEVEL_KEYS)
    params = _table_rows("### Job parameters")
    assert set(params) == set(JOB_PARAMS)
    assert {k for k, cells in params.items() if cells[1] == "yes"} == set(GRID_PARAMS)
    assert set(_table_rows("### `thresholds`")) == {f.name for f in fields(Thresholds)}
    assert set(_table_rows("### `precision_budget`")) == set(BUDGET_KEYS)
    assert set(_table_rows("### `timing`")) == set(TIMING_KEYS)
    verdicts = re.findall(r"^\| `([A-Z]+)` \|", DOC, flags=re.M)
    assert verdicts == list(VERDICTS)


def test_the_check_can_fail() -> None:
    """Negative control: a page without a key is caught."""
    assert _undocumented(DOC.replace("`tensor_parallel_size`", "").replace("tensor_parallel_size:", "")) == [
        "tensor_parallel_size"
    ]
