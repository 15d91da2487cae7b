"""A missing optional extra is one line naming `pip install 'ardit[...]'`, exit code 2, no traceback.

The extra is taken away in a child process (`sys.modules[name] = None` makes `import name` fail as if
it were not installed), so the real commands run exactly as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.extras import EXTRAS, MissingExtra, extra_for, needs_extra, require_extra
from tests.fixtures_sweep import spec_dict

REPO = Path(__file__).resolve().parents[1]


def _run_without(modules: list[str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    block = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    return subprocess.run(
        [sys.executable, "-c", f"import sys; {block}sys.argv[1:] = {list(args)!r}; {code}"],
        capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )  # fmt: skip


def _assert_one_line(proc: subprocess.CompletedProcess[str], extra: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"pip install 'ardit[{extra}]'" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_needs_extra_names_the_extra_and_lets_other_errors_through() -> None:
    with pytest.raises(MissingExtra, match=r"ardit report needs matplotlib, .*pip install 'ardit\[sweep\]'"):
        with needs_extra("sweep", "ardit report"):
            raise ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")
    with pytest.raises(ModuleNotFoundError, match="yaml"):  # not the extra's module: a real bug, kept
        with needs_extra("sweep", "ardit report"):
            raise ModuleNotFoundError("No module named 'yaml'", name="yaml")
    assert extra_for("skimage.metrics") == "sweep" and extra_for("boto3") == "s3" and extra_for("numpy") is None


def test_require_extra_checks_without_importing(monkeypatch) -> None:
    require_extra("sweep", "x")  # installed here
    monkeypatch.setitem(sys.modules, "skimage", None)
    with pytest.raises(MissingExtra, match=r"x needs scikit-image.*ardit\[sweep\]"):
        require_extra("sweep", "x")


def test_every_extra_is_declared_in_pyproject() -> None:
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)


def test_report_commands_without_the_report_extra(tmp_path: Path) -> None:
    cli = "from pipeline.sweep import app; app(prog_name='ardit')"
    _assert_one_line(_run_without(["matplotlib"], cli, "report", str(tmp_path)), "report")
    step = "from components.report.__main__ import main; sys.exit(main())"
    _assert_one_line(_run_without(["matplotlib"], step, "--sweep-dir", str(tmp_path)), "report")


def test_evaluate_step_without_the_sweep_extra(tmp_path: Path) -> None:
    code = "from components.evaluate.__main__ import main; sys.exit(main())"
    proc = _run_without(["skimage"], code, "--output", str(tmp_path), "--ref-run", "a", "--run", "b")
    _assert_one_line(proc, "sweep")


def test_sweep_without_the_sweep_extra_fails_before_any_job(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict()))
    cli = "from pipeline.sweep import app; app(prog_name='ardit')"
    proc = _run_without(["skimage"], cli, "sweep", str(spec), "--output", str(tmp_path / "out"), "--sweep-id", "s")
    _assert_one_line(proc, "sweep")
    assert not (tmp_path / "out").exists()  # caught before any work started
    # --dry-run needs no extra: it only expands the spec
    dry = _run_without(["skimage", "matplotlib"], cli, "sweep", str(spec), "--dry-run")
    assert dry.returncode == 0, dry.stderr
