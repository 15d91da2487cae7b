"""The compile caches kept in the job's storage: a fresh process starts from what an earlier one compiled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from components.data.objectstore import open_object_store
from components.engine.compile_cache import CompileCache, attach

ROOT = Path(__file__).resolve().parents[1]

# A process that restores the caches, compiles one function with Inductor (C++ on the CPU) and
# stores the caches again; it prints Inductor's FX-graph cache counters.
PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from components.data.objectstore import open_object_store
    from components.engine.compile_cache import CompileCache

    cache = CompileCache(open_object_store(sys.argv[1]), "_compile_cache/probe/rank0.tar", Path(sys.argv[2]))
    restored = cache.restore()
    import torch
    from torch._dynamo.utils import counters

    f = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    # Inductor's vectorized sin/cos differ from eager's by an ulp or so: an absolute tolerance (with
    # random inputs and atol 1e-8, a result near 0 failed it now and then)
    assert torch.allclose(f(x), torch.sin(x) * 2 + x.cos(), atol=1e-5)
    print(json.dumps({"restored": restored, "stored": cache.persist(),
                      "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))
""")


@pytest.fixture(autouse=True)
def compiler_cache_env(tmp_path, monkeypatch):
    """Restoring points this process's compilers at the cache: put them back after each test."""
    import components.engine.compile_cache as compile_cache

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "before" / name))
    monkeypatch.setattr(compile_cache, "_attached", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # attach's local directories
    (tmp_path / "tmp").mkdir()


def probe(store: Path, local: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE, str(store), str(local)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor compiles C++ on the CPU")
def test_a_fresh_process_finds_what_an_earlier_one_compiled(tmp_path):
    store = tmp_path / "output"
    first = probe(store, tmp_path / "machine-a")
    assert first["restored"] == 0 and first["miss"] >= 1 and first["hit"] == 0
    assert first["stored"] > 0 and (store / "_compile_cache/probe/rank0.tar").is_file()
    # another machine (an empty local directory): the stored caches make it a hit, and nothing new is stored
    second = probe(store, tmp_path / "machine-b")
    assert second["restored"] == first["stored"]
    assert second["hit"] >= 1 and second["miss"] == 0
    assert second["stored"] == 0


def test_a_cache_that_cannot_be_unpacked_costs_compiles_not_the_step(tmp_path, capsys):
    store = open_object_store(tmp_path / "output")
    store.put_bytes("_compile_cache/x/rank0.tar", b"not a tar archive")
    cache = CompileCache(store, "_compile_cache/x/rank0.tar", tmp_path / "local")
    cache.restore()
    assert "could not unpack _compile_cache/x/rank0.tar" in capsys.readouterr().err
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "local" / "inductor")  # it compiles into it
    (tmp_path / "local" / "inductor").mkdir(parents=True)
    (tmp_path / "local" / "inductor" / "kernel.py").write_text("# compiled")
    assert cache.persist() > 0  # the good caches replace the broken ones
    assert cache.persist() == 0  # nothing new since


def test_the_cache_is_off_on_the_cpu_and_when_turned_off(tmp_path, monkeypatch):
    from components.models import load_engine

    engine = load_engine("tiny", None, "cpu", None)
    monkeypatch.delenv("ARDIT_COMPILE_CACHE", raising=False)
    assert attach(str(tmp_path), engine) is None  # auto: nothing compiles on the CPU
    monkeypatch.setenv("ARDIT_COMPILE_CACHE", "off")
    assert attach(str(tmp_path), engine) is None
    monkeypatch.setenv("ARDIT_COMPILE_CACHE", str(tmp_path / "shared"))  # a place of its own: on anywhere
    cache = attach(str(tmp_path), engine, log=False)
    assert cache is not None and cache.key.startswith("_compile_cache/") and cache.key.endswith("/rank0.tar")
    assert cache.local_dir.is_relative_to(tmp_path / "tmp")
