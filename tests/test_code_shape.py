"""Code shape: no function or method under components/ or pipeline/ is longer than 100 lines, so
each one can be read on a screen or two. Checked on the source with `ast` (decorators excluded,
docstring included). A negative control plants a long function in a small tree under tmp_path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "pipeline")
MAX_LINES = 100


def long_functions(root: Path, packages: tuple[str, ...] = PACKAGES, limit: int = MAX_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method over `limit` lines."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_over_100_lines():
    assert long_functions(ROOT) == []


def test_a_long_function_is_found(tmp_path):
    pkg = tmp_path / "components"
    pkg.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))  # def line + 100 = 101 lines
    (pkg / "m.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path, ("components",)) == ["components/m.py:6 long (101 lines)"]
