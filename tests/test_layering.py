"""Layering: components are the parts, pipeline wires them; inside the engine the kernels are the
lowest layer. Checked on the source with `ast`, so an import inside a function (a lazy import, the
usual way a cycle hides) counts like one at the top of a module.

Rules:
- no import cycles among the modules of components/ and pipeline/;
- no module under components/ imports pipeline (the sweep takes its job runner as an argument;
  pipeline/sweep.py passes run_job);
- the kernels (components/engine/kernels/) import nothing of components but the kernels;
- the engine imports nothing of components outside it but the data layer (object store, images),
  errors and extras: never a step, the K/V store or the CLI;
- in particular the engine imports nothing of the runtime (components/runtime/: rank processes,
  step dispatch): the ranks hand the engine its ParallelContext, the engine never reaches back;
- the runtime imports no step (components.ar, .dit, .shard, .summary, .evaluate, .report): it runs
  whatever step function it is given, and what is step-specific (an AR step's restart from its
  halved budget) comes in with the call (run_step's `restart_from`).
- the model (components/engine/transformer.py) talks to no other rank: its pipeline stages' hand-offs
  are the runtime's PipelineStages (components/runtime/parallel.py), which `parallelize` gives a
  staged model from outside (`ctx.stages()`);
- no file of the engine reaches torch.distributed: the collectives are the runtime's.
Each rule has a negative control: a planted violation in a small tree under tmp_path is found.

An import of `a.b.c` counts as depending on the module `a.b.c` only, not on its parent packages,
whose `__init__` Python also runs (a package that imports its own submodules would otherwise be a
cycle by construction).
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "pipeline")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under root/<package>."""
    return {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _imported_names(module: str, path: Path) -> list[str]:
    """Every module name an import statement of the file names, anywhere in it (module level,
    functions, classes, `if` blocks), relative imports made absolute. `from x import y` gives
    `x.y`: the submodule y, or a name in x (`_import_graph` maps it to the module x then)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [f"{target}.{a.name}" for a in node.names]
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports (each imported name mapped to the longest
    known module it names or lies in)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle (a path of modules, first == last) through each set of modules that
    import each other, directly or not (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_shortest_cycle(graph, component) for component in components]


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _offenders(graph: dict[str, set[str]], inside: str, allowed: tuple[str, ...],
               watched: tuple[str, ...] = PACKAGES) -> list[str]:
    """Imports by modules in package `inside` of a module in `watched` outside `allowed`."""
    def within(name: str, packages: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in packages)

    return [f"{m} imports {t}" for m in sorted(graph) if within(m, (inside,))
            for t in sorted(graph[m]) if within(t, watched) and not within(t, allowed)]


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


GRAPH = _import_graph(_modules(ROOT))
STEPS = tuple(f"components.{step}" for step in ("ar", "dit", "shard", "summary", "evaluate", "report"))


# -- the rules -----------------------------------------------------------------------------------
def test_no_import_cycles() -> None:
    assert len(GRAPH) > 100  # the whole tree was read
    assert _cycles(GRAPH) == []


def test_components_never_import_pipeline() -> None:
    assert _offenders(GRAPH, "components", allowed=("components",)) == []


def test_kernels_import_nothing_of_components_but_kernels() -> None:
    assert GRAPH["components.engine.kernels.compiled_layers"]  # the kernels' own imports were read
    assert _offenders(GRAPH, "components.engine.kernels", allowed=("components.engine.kernels",)) == []


def test_engine_imports_no_step_store_or_cli() -> None:
    allowed = ("components.engine", "components.data", "components.errors", "components.extras")
    assert _offenders(GRAPH, "components.engine", allowed) == []


def test_engine_imports_nothing_of_the_runtime() -> None:
    assert GRAPH["components.runtime.dispatch"]  # the runtime's own imports were read
    assert _offenders(GRAPH, "components.engine", allowed=(), watched=("components.runtime",)) == []


def test_the_runtime_imports_no_step() -> None:
    assert all(step in GRAPH for step in STEPS)  # each step package was read (a renamed one is not missed)
    assert _offenders(GRAPH, "components.runtime", allowed=(), watched=STEPS) == []


# -- negative controls: each rule finds a planted violation --------------------------------------
def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    """Three modules, a -> b at module level, b -> c in a function, c -> a as `from . import`."""
    root = _write_tree(tmp_path, {
        "components/__init__.py": "",
        "components/pkg/__init__.py": "",
        "components/pkg/a.py": "from .b import run\n",
        "components/pkg/b.py": "def run():\n    from components.pkg.c import helper\n    return helper()\n",
        "components/pkg/c.py": "def helper():\n    from . import a\n    return a\n",
        "components/pkg/d.py": "from .a import run\n",  # imports into the cycle, not part of it
    })
    graph = _import_graph(_modules(root, ("components",)))
    assert graph["components.pkg.b"] == {"components.pkg.c"}
    assert _cycles(graph) == [["components.pkg.a", "components.pkg.b", "components.pkg.c", "components.pkg.a"]]


def test_a_two_module_cycle_between_a_package_and_its_submodule_is_found(tmp_path: Path) -> None:
    """The shape the kernels had: the package's __init__ imports, lazily, a module that imports
    one of the package's submodules, which imports the package."""
    root = _write_tree(tmp_path, {
        "components/__init__.py": "",
        "components/k/__init__.py": "def failure():\n    from ..p import Lost\n    return Lost\n",
        "components/k/moe.py": "from . import failure\n",
        "components/p.py": "from .k.moe import failure\nclass Lost(Exception): ...\n",
    })
    cycles = _cycles(_import_graph(_modules(root, ("components",))))
    assert cycles == [["components.k", "components.p", "components.k.moe", "components.k"]]


def test_a_planted_layering_violation_is_found(tmp_path: Path) -> None:
    root = _write_tree(tmp_path, {
        "components/__init__.py": "",
        "components/engine/__init__.py": "",
        "components/engine/transformer.py": "",
        "components/engine/kernels/__init__.py": "",
        "components/engine/kernels/fast.py": "def f():\n    from ..transformer import attend\n",
        "components/engine/kernels/ok.py": "from . import fast\nimport torch\n",
        "components/engine/ar.py": "def f():\n    from components.kvstore import open_store\n",
        "components/kvstore/__init__.py": "def open_store(): ...\n",
        "components/late.py": "def run():\n    from pipeline.local import run_job\n",
        "pipeline/__init__.py": "",
        "pipeline/local.py": "",
    })
    graph = _import_graph(_modules(root))
    assert _offenders(graph, "components.engine.kernels", allowed=("components.engine.kernels",)) == [
        "components.engine.kernels.fast imports components.engine.transformer"]
    assert _offenders(graph, "components.engine", allowed=("components.engine",)) == [
        "components.engine.ar imports components.kvstore"]
    assert _offenders(graph, "components", allowed=("components",)) == ["components.late imports pipeline.local"]


def test_an_engine_import_of_the_runtime_is_found(tmp_path: Path) -> None:
    root = _write_tree(tmp_path, {
        "components/__init__.py": "",
        "components/engine/__init__.py": "",
        "components/engine/parallel.py": "def pool():\n    from components.runtime.ranks import RankPool\n",
        "components/engine/ar.py": "from components.errors import ConfigError\n",
        "components/errors.py": "class ConfigError(Exception): ...\n",
        "components/runtime/__init__.py": "",
        "components/runtime/ranks.py": "from components.engine.parallel import pool\nclass RankPool: ...\n",
    })
    graph = _import_graph(_modules(root, ("components",)))
    assert _offenders(graph, "components.engine", allowed=(), watched=("components.runtime",)) == [
        "components.engine.parallel imports components.runtime.ranks"]


def test_a_runtime_import_of_a_step_is_found(tmp_path: Path) -> None:
    """A lazy import of the AR step's budget in the dispatch (where it was), and one of the DiT step
    package itself; the runtime's own modules and the data layer are no step."""
    root = _write_tree(tmp_path, {
        "components/__init__.py": "",
        "components/ar/__init__.py": "",
        "components/ar/budget.py": "def read_budget(): ...\n",
        "components/dit/__init__.py": "def run(): ...\n",
        "components/data/__init__.py": "",
        "components/data/runs.py": "class RunLayout: ...\n",
        "components/runtime/__init__.py": "",
        "components/runtime/ranks.py": "from components.data.runs import RunLayout\n",
        "components/runtime/dispatch.py": ("from .ranks import RunLayout\n"
                                           "def budget():\n    from components.ar.budget import read_budget\n"),
        "components/runtime/replicas.py": "from components import dit\n",
    })
    graph = _import_graph(_modules(root, ("components",)))
    steps = ("components.ar", "components.dit")
    assert _offenders(graph, "components.runtime", allowed=(), watched=steps) == [
        "components.runtime.dispatch imports components.ar.budget",
        "components.runtime.replicas imports components.dit"]


# the ParallelContext's point-to-point and collective calls, and rank / stage identities
RANK_CALLS = ("recv_stage", "recv_any_stage", "send_stage", "isend_stage", "isend_any_stage",
              "broadcast_from_last_stage", "wait_all", "all_reduce", "all_reduce_", "all_gather", "pp_rank",
              "is_last_stage", "is_first")


def _rank_calls(source: str) -> list[str]:
    """The attributes of RANK_CALLS the source reads (`ctx.send_stage(...)`, `pp.pp_rank`), by line."""
    return sorted(f"{node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr in RANK_CALLS)


def test_the_model_talks_to_no_other_rank() -> None:
    source = (ROOT / "components" / "engine" / "transformer.py").read_text()
    assert _rank_calls(source) == []


def test_a_stage_hand_off_in_the_model_is_found() -> None:
    """The shape transformer.py had: the model receiving from the stage before and sending on."""
    planted = ("class Model:\n"
               "    def across_stages(self, x, run_stage):\n"
               "        pp = self.pipeline\n"
               "        if pp.pp_rank > 0:\n"
               "            x = pp.recv_any_stage(pp.pp_rank - 1)\n"
               "        return pp.broadcast_from_last_stage(run_stage(x))\n")
    assert _rank_calls(planted) == ["4: .pp_rank", "5: .pp_rank", "5: .recv_any_stage",
                                    "6: .broadcast_from_last_stage"]


def _distributed_uses(source: str) -> list[str]:
    """Where the source reaches torch.distributed (an import of it, or `torch.distributed.x`), by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
            found.append(f"{node.lineno}: import")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.append(f"{node.lineno}: import")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed"
                                                                                 for a in node.names):
            found.append(f"{node.lineno}: import")
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            found.append(f"{node.lineno}: torch.distributed")
    return sorted(set(found))


def test_the_engine_knows_no_ranks() -> None:
    """No file of the engine reaches torch.distributed: the ranks' collectives and stage hand-offs
    are the runtime's (components/runtime/parallel.py), handed to the engine as its ParallelContext."""
    uses = {str(path.relative_to(ROOT)): _distributed_uses(path.read_text())
            for path in sorted((ROOT / "components" / "engine").rglob("*.py"))}
    assert {path: found for path, found in uses.items() if found} == {}
    assert _distributed_uses((ROOT / "components" / "runtime" / "parallel.py").read_text())  # the rule's reach


def test_a_collective_in_the_engine_is_found() -> None:
    """The shape engine/parallel.py had: the context's collectives inside the engine."""
    planted = ("class ParallelContext:\n"
               "    def all_reduce_(self, t):\n"
               "        import torch.distributed as dist\n"
               "        dist.all_reduce(t)\n"
               "def world():\n"
               "    return torch.distributed.get_world_size()\n")
    assert _distributed_uses(planted) == ["3: import", "6: torch.distributed"]
