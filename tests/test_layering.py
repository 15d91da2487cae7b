"""Layering: components are the parts, pipeline wires them. No module under components/ imports
pipeline (the sweep takes its job runner as an argument; pipeline/sweep.py passes run_job)."""

from __future__ import annotations

import ast
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parents[1] / "components"


def _imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def test_components_never_import_pipeline() -> None:
    offenders = [
        f"{path.relative_to(COMPONENTS.parent)} imports {mod}"
        for path in sorted(COMPONENTS.rglob("*.py"))
        for mod in _imported_modules(path)
        if mod == "pipeline" or mod.startswith("pipeline.")
    ]
    assert offenders == []


def test_the_check_sees_a_late_import(tmp_path: Path) -> None:
    """Negative control: an import inside a function body is found too."""
    f = tmp_path / "m.py"
    f.write_text("def run():\n    from pipeline.local import run_job\n    return run_job\n")
    assert _imported_modules(f) == ["pipeline.local"]
