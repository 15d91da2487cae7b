"""Each image's Python environment, built the way its Dockerfile builds it, passes the Dockerfile's
last step, `python -m pipeline.images check IMAGE`.

No Docker engine here, so the Dockerfile's Python part is replayed in a clean virtual environment
(no GPU): torch at the Dockerfile's TORCH_VERSION, then exactly `pip install -r` of the requirements
file the Dockerfile copies, then the project with `--no-deps`, then the check command of its last
RUN. The tools image installs the CPU torch, as here. The GPU image installs the CUDA build, which
cannot install here: the CPU build stands in (`check gpu --torch cpu`), so what only the CUDA build
brings (Triton) is the one thing not checked; everything in its requirements file is. The tools
check once failed on `import triton` (a CPU torch has none) after the long GPU build.

Offline: tests/run.sh runs the suite in a network namespace with loopback only, so it fetches the
images' wheels first into $ARDIT_IMAGE_WHEELS, which this test installs from (`--no-index`).
Without that variable, pip uses its configured indexes.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.images import IMAGES

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def dockerfile_python_steps(key: str) -> dict[str, str]:
    """What the Dockerfile of image ``key`` installs and checks: torch version, requirements file,
    the project install and the check command (its last RUN), read from the Dockerfile itself."""
    ins = _instructions(REPO / "images" / f"{key}.Dockerfile")
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    runs = [a for op, a in ins if op == "RUN"]
    copies = dict(reversed(a.split()) for op, a in ins if op == "COPY" and len(a.split()) == 2)
    (torch_run,) = [r for r in runs if r.startswith("pip install \"torch==")]
    assert torch_run.startswith('pip install "torch==${TORCH_VERSION}" --index-url'), torch_run
    requirements = [r.split(" -r ", 1)[1] for r in runs if r.startswith("pip install -r ")]
    assert len(requirements) == 1, runs
    project = [r for r in runs if r.startswith("pip install --no-deps /src")]
    assert project, runs
    assert ins[-1][0] == "RUN", ins[-1]
    return {"torch": args["TORCH_VERSION"], "requirements": copies[requirements[0]], "check": ins[-1][1],
            "cudart": next((r for r in runs if "ld.so.conf.d" in r), "")}


def _pip_source() -> list[str]:
    wheels = os.environ.get("ARDIT_IMAGE_WHEELS")
    if not wheels:
        return []
    assert Path(wheels).is_dir(), f"ARDIT_IMAGE_WHEELS={wheels} is not a directory (tests/run.sh fills it)"
    return ["--no-index", "--find-links", wheels]


def _has_libibverbs() -> bool:
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return False
    return True


def test_dockerfile_python_steps_are_read_from_the_dockerfiles():
    for key, image in IMAGES.items():
        steps = dockerfile_python_steps(key)
        assert steps["requirements"] == image.requirements
        assert steps["check"] == f"python -m pipeline.images check {key}"
        assert steps["torch"] == (REPO / "constraints.txt").read_text().strip().removeprefix("torch==")
    assert "nvidia.cuda_runtime" in dockerfile_python_steps("gpu")["cudart"]


@pytest.mark.parametrize("key", sorted(IMAGES))
def test_image_environment_from_its_requirements_passes_its_check(key, tmp_path):
    if not _has_libibverbs():
        if os.environ.get("CI") == "true":
            pytest.fail("libibverbs.so.1 is missing (the images install libibverbs1; tests/run.sh installs it)")
        pytest.skip("libibverbs.so.1 is missing (apt-get install libibverbs1): Mooncake cannot import")
    steps = dockerfile_python_steps(key)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv),
            "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=env, cwd=tmp_path, capture_output=True, text=True, **kw)

    # --no-compile: no bytecode for all of torch up front (CI time); what is installed is the same
    pip = [python, "-m", "pip", "install", "-q", "--no-compile", *_pip_source()]
    for cmd in ([*pip, f"torch=={steps['torch']}"], [*pip, "-r", str(REPO / steps["requirements"])]):
        done = run(*cmd)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stderr[-3000:]}"
    src = tmp_path / "src"  # the Dockerfile's COPY lines: pyproject.toml README.md components pipeline
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src)
    for name in ("components", "pipeline"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = run(*pip, "--no-deps", str(src))
    assert done.returncode == 0, done.stderr[-3000:]

    check = steps["check"].split()
    if key == "gpu":
        # the Dockerfile puts the CUDA runtime wheel's lib directory on the loader path (ldconfig)
        cmd = re.search(r'python -c "(.*?)"', steps["cudart"]).group(1)
        lib = run(python, "-c", cmd, check=True).stdout.strip()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [lib, env.get("LD_LIBRARY_PATH")]))
        check += ["--torch", "cpu"]  # the CPU torch stands in for the CUDA build
    done = run(*check)
    problems = [line for line in done.stderr.splitlines() if line.startswith("FAIL ")]
    if os.getuid() == 0:
        # The Dockerfile runs the check as uid 10001 (test_dockerfile_pins_user_and_build_time_check);
        # here the base interpreter may not be readable by another user, so root's one refusal is expected.
        problems.remove("FAIL running as root: the manifests require a non-root user (uid 10001)")
    assert problems == [], done.stdout + done.stderr
    assert done.returncode == (1 if os.getuid() == 0 else 0)
    # Triton comes with the CUDA torch only: neither image's check asks the CPU torch for it
    assert "not checked (brought only by another torch build than cpu; imported optionally): triton" in done.stdout
