"""Images: what each one must carry, checked from the compiled specs (no Docker engine here, so
nothing is built; the Dockerfiles run the same check, `python -m pipeline.images check`, at build time)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from pipeline.images import IMAGES, Image, check_image, read_requirements, requirement_closure, root_distributions
from pipeline.images import uncovered_imports as uncovered

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "images").glob("*.Dockerfile"))
KUBECTL = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")
THIRD_PARTY_IMAGES = {"chrislusf/seaweedfs:4.48"}  # dev overlay's S3 server


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _requirements(key: str) -> dict[str, str]:
    return read_requirements(REPO / IMAGES[key].requirements)


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["gpu.Dockerfile", "tools.Dockerfile"]
    assert sorted(IMAGES) == ["gpu", "tools"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_pins_user_and_build_time_check(dockerfile):
    ins = _instructions(dockerfile)
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    base = [a for op, a in ins if op == "FROM"]
    assert len(base) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base[0])
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+", image), f"base image not pinned: {image}"
    torch_pin = (REPO / "constraints.txt").read_text().strip()
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    runs = " ".join(a for op, a in ins if op == "RUN")
    for lib in ("libibverbs1", "rdma-core", "libnuma1", "libcurl4"):  # Mooncake links them even for TCP
        assert lib in runs
    users = [i for i, (op, a) in enumerate(ins) if op == "USER"]
    assert users and ins[users[-1]][1] not in ("root", "0")
    assert "--uid 10001" in runs  # the templates' securityContext runs as 10001
    key = dockerfile.name.split(".")[0]
    # the last instruction proves, as the non-root user, that the image runs its steps
    assert ins[-1] == ("RUN", f"python -m pipeline.images check {key}") and len(ins) - 1 > users[-1]
    copied = [a.split()[0] for op, a in ins if op == "COPY"]
    assert IMAGES[key].requirements in copied


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_existing_paths(dockerfile):
    for op, rest in _instructions(dockerfile):
        if op != "COPY":
            continue
        *sources, _dest = rest.split()
        for src in sources:
            if "[" in src:  # optional file via a one-character glob, e.g. README.m[d]
                continue
            assert glob.glob(str(REPO / src)), f"{dockerfile.name}: COPY {src} does not exist"


@pytest.mark.parametrize("key", sorted(IMAGES))
def test_requirements_are_pinned_and_cover_every_reachable_import(key):
    image = IMAGES[key]
    text = (REPO / image.requirements).read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[\w.\-\[\]]+==[\w.+\-]+", r) for r in lines)
    pins = _requirements(key)
    assert "torch" not in pins  # torch comes from its own index, first
    for step in image.modules:
        assert uncovered(step, image, pins) == {}, f"{image.requirements} misses imports of {step}"
    # exactly what the steps need: every pin is one of those distributions or something they require
    needed = requirement_closure(image)
    assert set(pins) == set(needed), ("regenerate with python -m pipeline.images requirements " + key)


def test_gpu_image_has_the_cuda_mooncake_and_the_tools_image_the_cpu_one():
    gpu, tools = _requirements("gpu"), _requirements("tools")
    assert "mooncake-transfer-engine" in gpu and "mooncake-transfer-engine-non-cuda" not in gpu
    assert gpu["mooncake-transfer-engine"] == tools["mooncake-transfer-engine-non-cuda"]  # the tested version
    assert "nvidia-cuda-runtime-cu12" in gpu  # libcudart.so.12 for the CUDA build
    assert "mooncake-transfer-engine" not in tools
    # the sweep runs in the GPU image: evaluate (scikit-image) and report (matplotlib) are there ...
    assert {"scikit-image", "matplotlib"} <= set(gpu)
    # ... and nothing runs them in the tools image
    assert not {"scikit-image", "matplotlib"} & set(tools)
    assert root_distributions(IMAGES["gpu"])["skimage"] == "scikit-image"


def test_coverage_check_would_catch_skimage_missing_from_the_sweeps_image():
    """Negative control: the sweep checked against the tools image's requirements misses skimage."""
    missing = uncovered("pipeline.sweep", IMAGES["tools"], _requirements("tools"))
    assert "skimage" in missing and "matplotlib" in missing
    gpu = _requirements("gpu")
    del gpu["scikit-image"]
    assert set(uncovered("pipeline.sweep", IMAGES["gpu"], gpu)) == {"skimage"}


def test_build_time_check_fails_on_a_missing_lazy_import(tmp_path, monkeypatch):
    """`python -m pipeline.images check` imports what a step can reach, lazy imports included."""
    pkg = tmp_path / "components_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import argparse\n\ndef run():\n    import no_such_module_ardit  # lazy\n\n"
        "argparse.ArgumentParser().parse_args()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("pipeline.images.FIRST_PARTY", ("components", "pipeline", "components_fake"))
    problems = check_image(Image(name="fake", requirements="", steps=("components_fake",), helpers=(),
                                 binaries=("no-such-binary-ardit",)))
    assert any("import no_such_module_ardit" in p for p in problems)
    assert any("no-such-binary-ardit" in p for p in problems)
    assert not any("--help" in p for p in problems)  # the step itself imports and answers --help


def _build_dry_run(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Run images/build.sh (DRY_RUN) into a copy of manifests/; returns its image refs and the copy."""
    manifests = tmp_path / "manifests"
    shutil.copytree(REPO / "manifests", manifests)
    env = dict(os.environ, DRY_RUN="1", REGISTRY="registry.example.com/ml",
               IMAGES_FILE=str(manifests / "images" / "kustomization.yaml"))
    done = subprocess.run(["bash", str(REPO / "images" / "build.sh")], env=env, capture_output=True, text=True,
                          check=True)
    refs = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and not line.startswith("+"))
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name in ("gpu", "tools"):
        assert re.fullmatch(rf"registry\.example\.com/ml/ardit-{name}:{re.escape(version)}-{sha}(-dirty)?",
                            refs[f"{name}_image"])
        assert f"docker build -f images/{name}.Dockerfile -t {refs[f'{name}_image']}" in done.stdout
    assert "docker push" not in done.stdout  # only with PUSH=1
    return refs, manifests


def test_committed_images_component_follows_the_build_tag_scheme():
    from pipeline.cluster import read_kustomize_images

    images = read_kustomize_images(REPO / "manifests" / "images" / "kustomization.yaml")
    assert set(images) == {"ardit-gpu", "ardit-tools"}
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    tags = {ref.rsplit(":", 1)[1] for ref in images.values()}
    assert len(tags) == 1 and re.fullmatch(rf"{re.escape(version)}-[0-9a-f]{{12}}(-dirty)?", tags.pop())
    assert all(ref.split(":")[0].endswith("/" + name) for name, ref in images.items())


def _step_module(command: list[str]) -> list[str]:
    """Modules a container command runs: the launcher and, after "--", the step (python -m X)."""
    modules = []
    for i, a in enumerate(command):
        if a == "-m" and i + 1 < len(command):
            modules.append(command[i + 1])
    return modules


def _check_coverage(image_ref: str, command: list[str], refs: dict[str, str], where: str) -> int:
    """The image a container runs is one build.sh produces, and it covers the container's modules."""
    if image_ref in THIRD_PARTY_IMAGES:
        return 0
    by_ref = {refs["gpu_image"]: "gpu", refs["tools_image"]: "tools"}
    assert image_ref in by_ref, f"{where}: image {image_ref} is not one images/build.sh produces"
    key = by_ref[image_ref]
    image = IMAGES[key]
    modules = _step_module(command)
    if command[:2] == ["python", "-c"]:  # inline helpers (standard library only)
        return 1
    assert modules, f"{where}: cannot tell what {command} runs"
    for module in modules:
        assert module in image.modules, f"{where}: {module} runs in {image.name}, which does not list it"
        assert uncovered(module, image, _requirements(key)) == {}, f"{where}: {image.name} misses imports of {module}"
    return 1


def test_rendered_dev_overlay_and_compiled_kfp_run_only_built_images_that_cover_their_steps(tmp_path):
    """Done-when of issue 14: the compiled sweep, batch edit and cron, rendered with the dev overlay,
    and the KFP pipelines compiled with --images, reference only images build.sh produces, and
    every step's imports are covered by the image that runs it."""
    from pipeline.cluster import ClusterSettings, read_kustomize_images
    from pipeline.kfp_pipelines import compile_pipelines

    refs, manifests = _build_dry_run(tmp_path)
    done = subprocess.run([KUBECTL, "kustomize", str(manifests / "overlays" / "dev")], capture_output=True, text=True,
                          check=True)
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    checked = {}
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert c["image"] in set(refs.values()) | THIRD_PARTY_IMAGES, name
                probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
                if probe:
                    _check_coverage(c["image"], probe, refs, f"{name} readinessProbe")
                if c["image"] == refs["tools_image"]:
                    binary = c["command"][0]  # the Mooncake servers
                    assert binary in IMAGES["tools"].binaries, f"{name}: {binary} not checked in the tools image"
        elif d["kind"] == "CronJob":
            for c in d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]:
                checked[name] = _check_coverage(c["image"], c["command"], refs, name)
        elif d["kind"] in ("WorkflowTemplate", "CronWorkflow"):
            for t in d["spec"].get("workflowSpec", d["spec"])["templates"]:
                if "container" in t:
                    c = t["container"]
                    checked[f"{name}/{t['name']}"] = _check_coverage(c["image"], c["command"], refs, name)
    assert {"WorkflowTemplate/ardit-accuracy-sweep/sweep", "WorkflowTemplate/ardit-batch-edit/dit-weights",
            "CronJob/ardit-kv-gc"} <= set(checked)
    # the cron is created from its own render (docs/deploy.md section 8), images pinned by --images
    from pipeline.argo import cron_workflow

    cron = yaml.safe_load(cron_workflow(ClusterSettings().with_images(
        read_kustomize_images(manifests / "images" / "kustomization.yaml"))).to_yaml())
    for t in cron["spec"]["workflowSpec"]["templates"]:
        if "container" in t:
            c = t["container"]
            checked[f"CronWorkflow/ardit-generate-dataset-cron/{t['name']}"] = _check_coverage(
                c["image"], c["command"], refs, "cron")
    assert "CronWorkflow/ardit-generate-dataset-cron/ar" in checked
    weights = subprocess.run([KUBECTL, "kustomize", str(manifests / "weights")], capture_output=True, text=True,
                             check=True)
    for d in yaml.safe_load_all(weights.stdout):
        if d and d["kind"] == "CronJob":  # the download runs in the tools image, which has huggingface_hub
            (c,) = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
            assert c["image"] == refs["tools_image"] and "huggingface_hub" in c["args"][0]
            assert "huggingface-hub" in (REPO / IMAGES["tools"].requirements).read_text()

    kfp_dir = tmp_path / "kfp"
    settings = ClusterSettings().with_images(read_kustomize_images(manifests / "images" / "kustomization.yaml"))
    for path in compile_pipelines(str(kfp_dir), settings):
        spec = next(yaml.safe_load_all(Path(path).read_text()))
        for name, ex in spec["deploymentSpec"]["executors"].items():
            c = ex["container"]
            checked[f"kfp/{Path(path).stem}/{name}"] = _check_coverage(c["image"], c["command"], refs, name)
    assert "kfp/accuracy_sweep/exec-sweep" in checked and "kfp/generate_dataset_scheduled/exec-ar" in checked


def test_vendored_copies_do_not_shadow_installed_distributions():
    """setuptools puts setuptools/_vendor on sys.path when imported (torch's compiler does): its
    importlib_metadata-8.x copy must not replace the installed one in the requirement closure."""
    import importlib.metadata

    import setuptools  # noqa: F401 - the import is the point

    from pipeline import images

    images._installed.cache_clear()
    try:
        assert images._installed()["importlib-metadata"].version == importlib.metadata.version("importlib_metadata")
    finally:
        images._installed.cache_clear()


def test_images_pinned_by_digest_reach_the_manifests_and_kfp(tmp_path):
    """docs/deploy.md section 1: the images component with kustomize's `digest:` field pins every
    rendered manifest and the KFP references (--images) to name@sha256:..., the documented check."""
    from pipeline.cluster import ClusterSettings, read_kustomize_images

    manifests = tmp_path / "manifests"
    shutil.copytree(REPO / "manifests", manifests)
    path = manifests / "images" / "kustomization.yaml"
    doc = yaml.safe_load(path.read_text())
    digests = {e["name"]: "sha256:" + f"{i + 1:x}" * 64 for i, e in enumerate(doc["images"])}
    for entry in doc["images"]:
        entry.pop("newTag")
        entry["digest"] = digests[entry["name"]]
    path.write_text(yaml.safe_dump(doc))
    refs = read_kustomize_images(path)
    assert all(refs[n].endswith("@" + d) for n, d in digests.items())
    done = subprocess.run([KUBECTL, "kustomize", str(manifests / "overlays" / "dev")], capture_output=True, text=True,
                          check=True)
    images = set(re.findall(r"^\s+image: (\S+)$", done.stdout, re.M))
    assert images - THIRD_PARTY_IMAGES == set(refs.values())  # the check in the docs: nothing else left
    s = ClusterSettings().with_images(refs)
    assert (s.gpu_image, s.tools_image) == (refs["ardit-gpu"], refs["ardit-tools"])
    assert "digest: sha256:" in (REPO / "docs" / "deploy.md").read_text()
