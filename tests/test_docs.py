"""The docs stay what their readers need: the README a short user guide, every environment switch
the code reads documented in one table, and no dated timings hidden in code comments."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("components", "pipeline")
ENV_NAME = re.compile(r"\bARDIT_[A-Z0-9_]+\b")
# a date next to a device name or a timing, in a comment: measurements belong in docs/benchmarks.md
DATED = re.compile(r"20\d\d-\d\d-\d\d(?!T)")  # a date, not an RFC 3339 timestamp example


def _python_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def env_switches_in_code() -> set[str]:
    names: set[str] = set()
    for path in _python_files():
        names |= set(ENV_NAME.findall(path.read_text()))
    return names


def documented_switches(doc: str) -> set[str]:
    """ARDIT_* names in the first column of the docs' table rows."""
    names: set[str] = set()
    for line in doc.splitlines():
        if line.startswith("| `ARDIT_"):
            names |= set(ENV_NAME.findall(line.split("|")[1]))
    return names


def dated_comments(source: str) -> list[str]:
    """Comments and docstrings (not other strings) of one Python source that carry a date."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and DATED.search(tok.string):
            found.append(f"line {tok.start[0]}: {tok.string.strip()}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and DATED.search(doc):
                found.append(f"docstring of {getattr(node, 'name', 'the module')}: {DATED.search(doc).group()}")
    return found


def test_the_readme_is_a_short_user_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: move details to docs/"


def test_every_environment_switch_is_documented_in_one_table():
    missing = env_switches_in_code() - documented_switches((ROOT / "docs" / "gpus.md").read_text())
    assert not missing, f"ARDIT_* switches read by the code but not in docs/gpus.md's table: {sorted(missing)}"


def test_the_switch_table_reader_sees_a_missing_row():
    # negative control: a table without ARDIT_DEBUG's row does not document it
    doc = "| `ARDIT_KERNELS` | fast kernels | on |\nsee ARDIT_DEBUG in the text\n"
    assert documented_switches(doc) == {"ARDIT_KERNELS"}


def test_no_dated_timings_in_code_comments():
    offenders = {str(p.relative_to(ROOT)): found for p in _python_files() if (found := dated_comments(p.read_text()))}
    assert not offenders, f"dated measurements in comments (put them in docs/benchmarks.md): {offenders}"


def test_the_comment_scan_finds_a_dated_comment_and_skips_strings():
    source = ('def f():\n    """Took 5.9 ms (2026-11-27)."""\n'
              'x = "2026-11-27"  # at 2026-11-22T02:00:00Z\ny = 1  # on 2 x H100 (2026-11-27) 5.9 ms\n')
    assert dated_comments(source) == ["line 4: # on 2 x H100 (2026-11-27) 5.9 ms", "docstring of f: 2026-11-27"]
