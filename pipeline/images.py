"""What each container image must carry, derived from the code the steps run.

The images (images/*.Dockerfile) are checked from both ends with the same code:

* at build time, ``python -m pipeline.images check gpu`` (a RUN step of the Dockerfile) imports
  every step module the image runs, runs each step's ``--help``, imports every third-party module
  those steps can reach (lazy imports included) and finds the server binaries on PATH;
* in CI, ``tests/test_orchestration_images.py`` reads the compiled KFP and Argo specs, maps each
  step's command to the image that runs it and checks that the image's requirements file names a
  distribution for every third-party module the step can reach.

"Can reach" is a static scan: the step's package and, transitively, every first-party module
(``components.*``, ``pipeline.*``) it imports, at any depth (inside functions too), so a lazily
imported backend (boto3, mooncake, skimage) counts. Imports under ``if TYPE_CHECKING:`` do not.

Standard library only: this runs inside the images before anything else is trusted.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

FIRST_PARTY = ("components", "pipeline")


@dataclass(frozen=True)
class Image:
    """One image: the step programs it runs, the binaries it must ship, its pinned requirements."""

    name: str  # kustomize / registry name: ardit-gpu, ardit-tools
    requirements: str  # images/requirements-*.txt, relative to the repository root
    steps: tuple[str, ...]  # step modules (python -m ...)
    helpers: tuple[str, ...] = ("pipeline.launch",)  # other modules the image runs (launcher, probes)
    binaries: tuple[str, ...] = ()
    # Modules some distribution in this image provides under another distribution name than the
    # one this environment has (the CUDA and non-CUDA Mooncake wheels both install `mooncake`).
    provides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Pinned requirements no module imports (native libraries another wheel loads).
    extra_requirements: tuple[str, ...] = ()
    # Which torch build the Dockerfile installs first (its own index): "cuda" or "cpu".
    torch_build: str = "cpu"

    @property
    def with_torch(self) -> tuple[str, ...]:
        """Modules this image gets as dependencies of its torch build, not from its requirements file."""
        return TORCH_BRINGS[self.torch_build]

    @property
    def modules(self) -> tuple[str, ...]:
        return self.steps + self.helpers


# The two images and what runs in them. The workflow specs choose images per step
# (pipeline.cluster.STEP_IMAGE); the tests check that every compiled step lands in an image that
# lists its module here and whose requirements cover its imports.
IMAGES = {
    "gpu": Image(
        name="ardit-gpu",
        requirements="images/requirements-gpu.txt",
        steps=("components.ar", "components.dit", "pipeline.sweep"),
        # The CUDA build of Mooncake (GPU memory registration, RDMA): built against CUDA 12, so it
        # loads libcudart.so.12, which this wheel ships (the CUDA 13 driver runs CUDA 12 code).
        provides={"mooncake": ("mooncake-transfer-engine",)},
        extra_requirements=("nvidia-cuda-runtime-cu12==12.9.79",),
        torch_build="cuda",
    ),
    "tools": Image(
        name="ardit-tools",
        requirements="images/requirements-tools.txt",
        steps=("components.shard", "components.summary"),
        helpers=("pipeline.launch", "pipeline.probes", "components.kvstore.cli"),
        binaries=("mooncake_master", "mooncake_client", "mooncake_http_metadata_server"),
        provides={"mooncake": ("mooncake-transfer-engine-non-cuda",)},
        torch_build="cpu",
    ),
}

# Distributions installed separately from the requirements files (the Dockerfiles install torch
# first from the PyTorch index that matches the image's CUDA, or the CPU index).
INSTALLED_SEPARATELY = ("torch",)
# Modules each torch build brings as its own dependencies: the CUDA build depends on Triton; the
# CPU build does not ship it, and the engine imports it only where it is optional
# (kernels/decode_attention.py, kernels/fp8_grouped.py run only on CUDA). So Triton is neither in a
# requirements file nor checked in the tools image (CPU torch), and must import in the GPU image.
TORCH_BRINGS: dict[str, tuple[str, ...]] = {"cuda": ("triton",), "cpu": ()}
INSTALLED_WITH_TORCH = tuple(sorted({m for ms in TORCH_BRINGS.values() for m in ms}))


def _module_file(name: str) -> Path | None:
    """Source file of a first-party module or package, found on disk without importing anything
    (importing a submodule would run its packages' __init__, torch and all). None: not a module."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root, *rest)
        for candidate in (path / "__init__.py", path.with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> Iterable[tuple[str, bool]]:
    """``(dotted name, surely a module)`` for every import in ``tree`` (relative imports resolved,
    TYPE_CHECKING blocks skipped). ``from pkg import x`` yields ``pkg`` (a module) and ``pkg.x``
    (a module only sometimes)."""
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterable[tuple[str, bool]]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, True
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            yield origin, True
            for alias in node.names:
                yield f"{origin}.{alias.name}", False
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(tree)


@functools.lru_cache(maxsize=None)
def _scan(module: str) -> dict[str, frozenset[str]]:
    """Third-party modules (dotted, as imported) reachable from ``module``: ``{name: {importing modules}}``."""
    stdlib = set(sys.stdlib_module_names)
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = [module, f"{module}.__main__"]  # `python -m package` runs package.__main__
    # a module also runs its parent packages' __init__
    parts = module.split(".")
    todo += [".".join(parts[:i]) for i in range(1, len(parts))]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported, surely_module in _imported_names(tree, name, path.name == "__init__.py"):
            top = imported.split(".")[0]
            if not top or top in stdlib or top == "__future__":
                continue
            if top in FIRST_PARTY:
                pieces = imported.split(".")
                todo += [".".join(pieces[:i]) for i in range(1, len(pieces) + 1)]
            elif surely_module:
                found.setdefault(imported, set()).add(name)
    return {k: frozenset(v) for k, v in found.items()}


def third_party_imports(module: str) -> dict[str, set[str]]:
    """Top-level third-party modules reachable from ``module``: ``{top-level name: {importing modules}}``.

    "Reachable": imported by the module, its package's ``__main__``, or any first-party module they
    import, at any depth and inside functions too (lazy backends count). Modules that come with
    torch (INSTALLED_WITH_TORCH) are left out."""
    tops: dict[str, set[str]] = {}
    for name, users in _scan(module).items():
        top = name.split(".")[0]
        if top not in INSTALLED_WITH_TORCH:
            tops.setdefault(top, set()).update(users)
    return tops


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, importlib.metadata.Distribution]:
    """The distribution import resolves first for each name. Copies vendored inside another package
    (setuptools/_vendor/importlib_metadata-8.x, on sys.path once setuptools is imported, e.g. by
    torch's compiler) are not what pip installed and are skipped."""
    found: dict[str, importlib.metadata.Distribution] = {}
    for d in importlib.metadata.distributions():
        if "_vendor" in Path(str(d.locate_file(""))).parts:
            continue
        found.setdefault(normalize(d.metadata["Name"]), d)
    return found


def normalize(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


def distributions_for(modules: Iterable[str], image: Image | None = None) -> dict[str, set[str]]:
    """``{top-level module: {distributions that provide it}}`` (normalized names); empty set: none known."""
    known = _packages_distributions()
    out = {}
    for m in modules:
        dists = {normalize(d) for d in known.get(m, ())}
        if image and m in image.provides:
            dists |= {normalize(d) for d in image.provides[m]}
        out[m] = dists
    return out


def read_requirements(path: str | Path) -> dict[str, str]:
    """``{normalized name: version}`` of a pinned requirements file."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name.split("[")[0])] = version
    return pins


def uncovered_imports(step_module: str, image: Image, requirements: dict[str, str]) -> dict[str, set[str]]:
    """Third-party modules ``step_module`` can import that no distribution in ``requirements`` provides.

    ``{module: {distributions that would provide it}}``; empty when the image covers the step.
    """
    have = set(requirements) | {normalize(d) for d in INSTALLED_SEPARATELY}
    missing = {}
    for module, dists in distributions_for(third_party_imports(step_module), image).items():
        if not dists & have:
            missing[module] = dists
    return missing


def image_imports(image: Image) -> dict[str, set[str]]:
    """Third-party modules any module the image runs can reach: ``{module: {importing modules}}``."""
    found: dict[str, set[str]] = {}
    for module in image.modules:
        for name, users in third_party_imports(module).items():
            found.setdefault(name, set()).update(users)
    return found


def root_distributions(image: Image) -> dict[str, str]:
    """``{module: distribution}`` the image must install, one distribution per reachable module.

    Raises LookupError for a module no installed distribution provides."""
    roots = {}
    for module, dists in sorted(distributions_for(image_imports(image), image).items()):
        preferred = [d for d in dists if d in {normalize(x) for x in image.provides.get(module, ())}]
        if not dists:
            raise LookupError(f"no installed distribution provides {module!r}")
        roots[module] = (preferred or sorted(dists))[0]
    return roots


def requirement_closure(image: Image) -> dict[str, str]:
    """``{distribution: version}``: the image's root distributions and everything they require, as
    installed in this environment (torch excluded: the Dockerfiles install it from its own index)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    skip = {normalize(d) for d in INSTALLED_SEPARATELY}
    # a substituted distribution (CUDA build) has the same requirements as the one installed here
    installed_as = {normalize(d): m for m, ds in image.provides.items() for d in ds}
    env = default_environment() | {"extra": ""}
    todo = list(root_distributions(image).values())
    versions: dict[str, str] = {}
    while todo:
        dist = todo.pop()
        if dist in versions or dist in skip:
            continue
        local = dist
        if dist in installed_as:
            local = sorted(_packages_distributions()[installed_as[dist]])[0]
        meta = _installed()[normalize(local)]
        versions[dist] = meta.version
        for line in meta.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(normalize(req.name))
    for pin in image.extra_requirements:
        name, _, version = pin.partition("==")
        versions[normalize(name)] = version
    return dict(sorted(versions.items()))


# ------------------------------------------------------------------ build-time check


def _import(module: str) -> str | None:
    """Import in a fresh interpreter (a broken native library must not take this process down)."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


_IMPORT_ALL = """
import importlib, json, sys
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name)
print(json.dumps(failed))
"""


def _imports(modules: Iterable[str]) -> dict[str, str]:
    """``{module: error}`` for the modules that do not import. All are tried in one fresh interpreter
    first (one torch import instead of one per module); those that fail there, or all of them if
    that interpreter dies (a crashing native library), again each in its own for the message."""
    modules = sorted(modules)
    if not modules:
        return {}
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *modules], capture_output=True, text=True, check=False)
    try:
        suspects = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else modules
    except (IndexError, ValueError):
        suspects = modules
    return {m: err for m in suspects if (err := _import(m)) is not None}


def _torch_build() -> str | None:
    """"cuda" or "cpu": the build of the installed torch (None: torch does not import)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print('cuda' if torch.version.cuda else 'cpu')"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


# Libraries only the NVIDIA driver provides; the container runtime mounts them into GPU pods, so
# at build time (no driver) a module that links them cannot be imported, only checked with ldd.
DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


def _missing_libraries(module: str) -> set[str]:
    """Shared libraries a native extension module needs that the dynamic loader cannot find (ldd)."""
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return set()
    if spec is None or not spec.origin or not spec.origin.endswith(".so"):
        return set()
    out = subprocess.run(["ldd", spec.origin], capture_output=True, text=True, check=False).stdout
    return {line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line}


def check_image(key: str | Image, torch_build: str | None = None) -> list[str]:
    """Problems with the current environment as image ``key``; empty when it can run its steps.

    ``torch_build``: the torch build installed in place of the image's own (None: the image's own,
    which is checked). A CPU torch standing in for the GPU image's CUDA build (tests: no CUDA wheels
    here) brings none of what only the CUDA build brings (Triton), so that is not checked then."""
    image = IMAGES[key] if isinstance(key, str) else key
    problems = []
    expected = torch_build or image.torch_build
    if (found := _torch_build()) != expected:
        problems.append(f"torch: expected the {expected} build, found {found or 'none (import failed)'}")
    brought = TORCH_BRINGS[expected]
    modules: set[str] = set()
    for step in image.modules:
        if (err := _import(step)) is not None:
            problems.append(f"import {step}: {err}")
        if step in image.steps:
            done = subprocess.run([sys.executable, "-m", step, "--help"], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                problems.append(f"python -m {step} --help exited {done.returncode}: {done.stderr.strip()[-500:]}")
        modules |= set(_scan(step))
    # What a torch build brings is checked only where this torch brings it: elsewhere the code
    # imports it optionally (and no requirements file names it).
    skipped = sorted(m for m in modules if m.split(".")[0] in INSTALLED_WITH_TORCH and m.split(".")[0] not in brought)
    if skipped:
        print(f"not checked (brought only by another torch build than {expected}; imported optionally): "
              f"{', '.join(skipped)}")
    for module, err in sorted(_imports(modules - set(skipped)).items()):
        missing = _missing_libraries(module) if "cannot open shared object file" in err else set()
        if missing and missing <= set(DRIVER_LIBRARIES):
            print(f"ok (needs the GPU driver's {', '.join(sorted(missing))} at run time): {module}")
            continue
        problems.append(f"import {module}: {err}" + (f" (missing: {', '.join(sorted(missing))})" if missing else ""))
    for binary in image.binaries:
        if shutil.which(binary) is None:
            problems.append(f"binary {binary} not on PATH")
    if os.getuid() == 0:
        problems.append("running as root: the manifests require a non-root user (uid 10001)")
    return problems


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.images", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check this environment can run the image's steps (exit 1 if not)")
    c.add_argument("image", choices=sorted(IMAGES))
    c.add_argument("--torch", choices=sorted(TORCH_BRINGS), default=None,
                   help="the torch build installed in place of the image's own (tests put the CPU build in the "
                        "GPU image's place: what only the CUDA build brings, Triton, is then not checked)")
    s = sub.add_parser("imports", help="third-party modules a step module can reach, and who imports them")
    s.add_argument("module")
    r = sub.add_parser("requirements", help="print the image's pinned requirements (closure from this environment)")
    r.add_argument("image", choices=sorted(IMAGES))
    args = p.parse_args(argv)
    if args.cmd == "requirements":
        image = IMAGES[args.image]
        print(f"# {image.name}: what {', '.join(image.modules)} can import, and everything that needs.\n"
              f"# Generated by `python -m pipeline.images requirements {args.image}` from the project's tested\n"
              "# environment (torch is installed first by the Dockerfile from its own index). Regenerate when\n"
              "# the steps' imports change; tests/test_orchestration_images.py checks the coverage.")
        for dist, version in requirement_closure(image).items():
            print(f"{dist}=={version}")
        return 0
    if args.cmd == "imports":
        for module, users in sorted(third_party_imports(args.module).items()):
            print(f"{module:20s} {', '.join(sorted(users))}")
        return 0
    problems = check_image(args.image, torch_build=args.torch)
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr)
    if not problems:
        print(f"image {args.image}: {', '.join(IMAGES[args.image].steps)} import and answer --help; "
              f"every reachable third-party module imports")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
