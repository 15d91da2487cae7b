"""Static checks of images/ (no Docker engine here, so nothing is built)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["gpu.Dockerfile", "tools.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_and_user(dockerfile):
    ins = _instructions(dockerfile)
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    base = [a for op, a in ins if op == "FROM"]
    assert len(base) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base[0])
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+", image), f"base image not pinned: {image}"
    torch_pin = (REPO / "constraints.txt").read_text().strip()
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "libibverbs1" in runs and "rdma-core" in runs  # Mooncake needs them even over TCP
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert "--uid 10001" in runs  # the templates' securityContext runs as 10001


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_existing_paths_and_pinned_requirements(dockerfile):
    for op, rest in _instructions(dockerfile):
        if op != "COPY":
            continue
        *sources, _dest = rest.split()
        for src in sources:
            if "[" in src:  # optional file via a one-character glob, e.g. README.m[d]
                continue
            assert glob.glob(str(REPO / src)), f"{dockerfile.name}: COPY {src} does not exist"
            if src.startswith("images/requirements"):
                reqs = [line for line in (REPO / src).read_text().splitlines() if line and not line.startswith("#")]
                assert all(re.fullmatch(r"[\w.\-\[\]]+==[\w.+\-]+", r) for r in reqs), src
                assert not any(r.lower().startswith("torch==") for r in reqs)  # torch comes from its own index


def test_build_script_tag_scheme():
    env = dict(os.environ, DRY_RUN="1", REGISTRY="registry.example.com/ml")
    done = subprocess.run(["bash", str(REPO / "images" / "build.sh")], env=env, capture_output=True, text=True,
                          check=True)
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    refs = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and not line.startswith("+"))
    for name in ("gpu", "tools"):
        assert re.fullmatch(rf"registry\.example\.com/ml/ardit-{name}:{re.escape(version)}-{sha}(-dirty)?", refs[f"{name}_image"])
        assert f"docker build -f images/{name}.Dockerfile -t {refs[f'{name}_image']}" in done.stdout
    assert "docker push" not in done.stdout  # only with PUSH=1
