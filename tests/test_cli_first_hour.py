"""A new user's first hour with `ardit` (issue 20, items 8-13): an empty dataset, a checkpoint
without its weights, cheap checks answered before torch is imported and without creating the
output directory, the resume command as it can be pasted, "loading model ...", the load time in
the summary, "nothing to do" on a finished run, `ardit store up` without its extra."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_cli_errors import ardit, one_line_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    from components.data.sample import write_sample_edit_dataset, write_sample_generate_dataset

    d = tmp_path_factory.mktemp("ds")
    empty = d / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "instruction": pa.array([], pa.string()),
                             "image": pa.array([], pa.binary())}), empty)
    return {"edit": write_sample_edit_dataset(str(d / "edit.parquet"), n=1, size=64),
            "generate": write_sample_generate_dataset(str(d / "gen.parquet"), n=1),
            "empty": str(empty)}


# ------------------------------------------------------------------ 8. an empty dataset


def test_an_empty_dataset_is_one_line_and_writes_nothing(capfd, tmp_path, datasets):
    out = tmp_path / "out"
    code, stdout, err = ardit(capfd, "edit", datasets["empty"], "-o", str(out))
    one_line_error(code, err, datasets["empty"], "has no rows")
    assert "run " not in stdout and not out.exists()


def test_the_shard_step_refuses_an_empty_dataset_too(tmp_path, datasets):
    proc = subprocess.run([sys.executable, "-m", "components.shard", "--dataset", datasets["empty"], "--output",
                           str(tmp_path / "out"), "--run-id", "r", "--num-shards", "2", "--kind", "edit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    one_line_error(proc.returncode, proc.stderr, "has no rows")
    assert not (tmp_path / "out" / "r" / "inputs").exists()


# -------------------------------------------------------- 9. a checkpoint without weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tests.fixtures_checkpoint import write_official_checkpoint

    return write_official_checkpoint(tmp_path_factory.mktemp("ckpt") / "HunyuanImage-3.0-Instruct")


def _copy_without(src: Path, dst: Path, drop) -> Path:
    shutil.copytree(src, dst, ignore=lambda _, names: [n for n in names if drop(n)])
    return dst


def test_a_checkpoint_without_weights_is_refused_up_front(capfd, tmp_path, datasets, checkpoint):
    bare = _copy_without(checkpoint, tmp_path / "bare", lambda n: n.endswith((".safetensors", ".index.json")))
    out = tmp_path / "out"
    code, stdout, err = ardit(capfd, "edit", datasets["edit"], "-o", str(out), "--model", str(bare))
    one_line_error(code, err, f"--model {bare}", "no model.safetensors.index.json or model.safetensors",
                   "--dummy-weights")
    assert "run " not in stdout and not out.exists()

    shards = sorted(p.name for p in checkpoint.glob("model-*.safetensors"))
    assert len(shards) > 1
    partial = _copy_without(checkpoint, tmp_path / "partial", lambda n: n == shards[-1])
    code, _, err = ardit(capfd, "edit", datasets["edit"], "-o", str(out), "--model", str(partial))
    one_line_error(code, err, "lacks 1 shard(s) named in model.safetensors.index.json", shards[-1],
                   "download is incomplete")
    assert not out.exists()

    # --weights names the directory that lacks them
    code, _, err = ardit(capfd, "edit", datasets["edit"], "-o", str(out), "--model", str(checkpoint),
                         "--weights", str(bare))
    one_line_error(code, err, f"--weights {bare}")

    # --dummy-weights needs none: the checks go on to the next one (the KV store here)
    code, _, err = ardit(capfd, "edit", datasets["edit"], "-o", str(out), "--model", str(bare), "--dummy-weights",
                         "--kv-store", "mooncake://127.0.0.1:1")
    one_line_error(code, err, "mooncake://127.0.0.1:1", "unreachable")


# ------------------------------------- 11. cheap checks first: no torch, no output directory


def _blocked_gpu() -> bool:
    return Path("/dev/nvidiactl").exists()


CHEAP_FAILURES = {
    "wrong columns": (["edit", "{generate}"], "has no 'instruction' column"),
    "empty dataset": (["edit", "{empty}"], "has no rows"),
    "output is a file": (["edit", "{edit}", "-o", "{file}"], "is a file"),
    "output under a file": (["edit", "{edit}", "-o", "{file}/sub"], "is a file"),
    "kv store scheme": (["edit", "{edit}", "--kv-store", "redis://x"], "unknown scheme"),
    "kv store under a file": (["edit", "{edit}", "--kv-store", "local://{file}/kv"], "is a file"),
    "device cuda": (["edit", "{edit}", "--device", "cuda"], "no CUDA GPU"),
    "model name typo": (["edit", "{edit}", "--model", "hunyuan-image3"], "did you mean hunyuan-image-3?"),
    "output nobody can write": (["edit", "{edit}", "-o", "/proc/ardit-out"], "cannot write there"),
}


@pytest.mark.parametrize("case", sorted(CHEAP_FAILURES))
def test_cheap_checks_fail_before_torch_is_imported(tmp_path, datasets, case):
    """Each of these mistakes is answered without importing torch or the engine (which takes
    seconds to tens of seconds), and leaves no output directory behind."""
    if case == "device cuda" and _blocked_gpu():
        pytest.skip("this machine has an NVIDIA GPU")
    args, needle = CHEAP_FAILURES[case]
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "out"
    args = [a.format(file=tmp_path / "a_file", **datasets) for a in args]
    if "-o" not in args:
        args += ["-o", str(out)]
    code = ("import sys; from pipeline.cli import main; rc = main(sys.argv[1:]); "
            "print([m for m in ('torch', 'components.engine', 'transformers') if m in sys.modules]); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    one_line_error(proc.returncode, proc.stderr, needle)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
    assert not out.exists()


def test_a_failing_last_check_leaves_no_output_directory(capfd, tmp_path, datasets):
    """The KV store is asked last, after the engine's checks: still nothing is created."""
    out = tmp_path / "out"
    code, _, err = ardit(capfd, "edit", datasets["edit"], "-o", str(out), "--kv-store", "mooncake://127.0.0.1:1")
    one_line_error(code, err, "unreachable")
    assert not out.exists()


# ------------------------------------------------------- 10. the resume command, as it runs


def test_the_resume_command_starts_the_way_ardit_was_started(tmp_path, monkeypatch):
    from pipeline.cli import _invoked_as

    script = tmp_path / "venv" / "bin" / "ardit"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["venv/bin/ardit", "edit", "x.parquet"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert _invoked_as() == ["venv/bin/ardit"]  # not on PATH: the path, as typed
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", [str(script), "edit", "x.parquet"])
    assert _invoked_as() == ["ardit"]  # the shell finds this very script as `ardit`
    monkeypatch.setattr(sys, "argv", [str(ROOT / "pipeline" / "cli.py"), "edit", "x.parquet"])
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "pipeline.cli", "edit", "x.parquet"])
    assert _invoked_as() == ["python3", "-m", "pipeline.cli"]


def test_the_readme_flow_runs_pasted_line_by_line():
    """Every bare `ardit` in a README code block comes after the venv was activated (or the
    command names .venv/bin/ardit): pasted in order, each line finds the command."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    activated = False
    for block in blocks:
        for line in block.splitlines():
            for command in re.split(r"&&|;", line):
                words = shlex.split(command.strip()) if command.strip() else []
                if words[:1] == ["source"] and words[1:2] == [".venv/bin/activate"]:
                    activated = True
                if words[:1] == ["ardit"]:
                    assert activated, f"`{command.strip()}` runs before the venv is activated"
    assert activated


# ------------------------- 12. loading model, load time, "nothing to do"; 10. resume as printed


@pytest.mark.slow
def test_a_job_says_what_it_loads_accounts_for_it_and_resumes_as_printed(tmp_path, datasets):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pipeline.cli", "edit", datasets["edit"], "-o", str(out), "--num-shards", "1",
           "--steps", "1", "--max-new-tokens", "1", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    loading = [ln for ln in proc.stderr.splitlines() if ln.startswith("loading model ")]
    assert loading == ["loading model tiny (tiny test size, from seeded random weights: nothing read) …"], proc.stderr
    assert proc.stderr.index("loading model") < proc.stderr.index("AR  shard 0")  # before the first step's line

    resume = next(ln for ln in proc.stdout.splitlines() if ln.startswith("resume with: "))[len("resume with: "):]
    assert shlex.split(resume)[:3] == [sys.executable, "-m", "pipeline.cli"]  # as it was started here
    run_id = shlex.split(resume)[-1]
    summary = json.loads((out / run_id / "summary.json").read_text())
    split = summary["time_split_s"]
    assert set(split) == {"load", "ar", "kv", "dit", "other"}
    assert split["load"] > 0 and split["other"] is not None
    assert sum(split.values()) == pytest.approx(summary["wall_s"], rel=0.01)
    steps = [json.loads((out / run_id / "shards" / "0" / "steps" / f"{s}.json").read_text()) for s in ("ar", "dit")]
    assert steps[0]["load_s"] > 0 and steps[1]["load_s"] == 0  # one load per process: the DiT reused it
    assert steps[0]["wall_s"] > 0 and steps[1]["wall_s"] > 0
    assert steps[0]["scheduler"]["mean_batch"] >= 1 and steps[0]["scheduler"]["oom_retries"] == 0
    assert steps[0]["memory"] == steps[1]["memory"] == {}  # GPU memory is recorded on GPUs only
    assert steps[0]["compile"] == steps[1]["compile"] == {"frames": 0, "seconds": 0.0}  # the CPU's kernels: plain
    assert steps[0]["scheduler"]["kv_budget_bytes"] is steps[0]["scheduler"]["outside_allocator_bytes"] is None
    recorded = summary["shards"][0]["steps"]["ar"]["scheduler"]  # the summary rounds its floats
    assert summary["shards"][0]["steps"]["dit"]["compile"] == steps[1]["compile"]
    assert recorded["decode_steps"] == steps[0]["scheduler"]["decode_steps"] > 0
    assert summary["ar_oom_retries"] == summary["gpu_alloc_retries"] == 0
    assert summary["checks_s"] > 0 and summary["start_s"] > 0  # the checks and the CLI's start, before the job's clock
    assert summary["close_s"] is None  # no rank processes to stop at tp x pp 1
    assert "GPU memory ran short" not in proc.stdout

    again = subprocess.run(resume, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines() == [
        f"run {run_id}: nothing to do: all 1 shard(s) are committed (1 image(s)); summary: {out}/{run_id}/summary.json"]
    assert "loading model" not in again.stderr
    assert not (out / run_id / "_kv").exists()
    assert json.loads((out / run_id / "summary.json").read_text()) == summary  # left as it was


# ----------------------------------------------------------------- 13. store up, no extra


def test_store_up_without_the_mooncake_extra(capfd, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if `ardit[mooncake]` were not installed
    code, stdout, err = ardit(capfd, "store", "up", "--state-dir", str(tmp_path / "state"))
    one_line_error(code, err, "ardit store up", "pip install 'ardit[mooncake]'")
    assert not (tmp_path / "state").exists()  # nothing started, nothing written


def test_an_unsupported_size_lists_the_supported_ones():
    from components.data.datasets import validate_rows
    from components.models import model_validators

    _, is_supported_size, _ = model_validators("tiny")
    _, errors = validate_rows([{"id": "a", "prompt": "a fox", "size": "123x77"}], "generate",
                              is_supported_size=is_supported_size)
    assert errors[0].error.startswith("size '123x77' is not supported (use auto or one of ")
    assert "256x256" in errors[0].error and ";" not in errors[0].error  # tiny's square bucket; one problem


# ------------------------------------------------------------------ issue 35


def test_the_quick_model_name_check_knows_every_model_name():
    """check_model_name keeps its own list (it runs before the engine is imported): every name the
    engine resolves passes it, and a name it refuses is refused by the engine too."""
    from components.engine import resolve
    from components.errors import ConfigError
    from components.preflight import MODEL_NAMES, check_model_name
    from components.models import resolve_model

    assert set(resolve.PRESETS) <= set(MODEL_NAMES)
    assert getattr(resolve, "DEMO", "demo") in MODEL_NAMES
    for name in resolve.PRESETS:
        check_model_name(name)
    for typo in ("tinyy", "hunyuan-image3", "Tiny"):
        with pytest.raises(ConfigError, match=f"--model {typo}: unknown model"):
            check_model_name(typo)
        with pytest.raises(ConfigError, match="unknown model"):
            resolve_model(typo)


def test_forced_cot_lengths_take_any_preset_without_weights(monkeypatch, tmp_path):
    """The presets load seeded random weights (as --help says), so ARDIT_BENCH_COT_TOKENS needs no
    --dummy-weights with them; with real weights it is still refused."""
    from components.errors import ConfigError
    from components.options import check_bench_cot

    monkeypatch.setenv("ARDIT_BENCH_COT_TOKENS", "8")
    assert check_bench_cot("hunyuan-image-3", None, False) is not None
    assert check_bench_cot("tiny", None, False) is not None
    with pytest.raises(ConfigError, match="ARDIT_BENCH_COT_TOKENS='8': forces CoT lengths"):
        check_bench_cot("hunyuan-image-3", str(tmp_path), False)


def test_the_load_line_says_cpu_processes_off_the_gpu():
    from components.models import describe_load

    assert "2 CPU processes" in describe_load("tiny", None, False, None, 2, "cpu")
    assert "4 GPUs" in describe_load("tiny", None, False, None, 2, "cuda", pipeline_parallel_size=2)
    assert "GPU" not in describe_load("tiny", None, False, None, 1, "cpu", pipeline_parallel_size=2)


@pytest.mark.parametrize("debug", [False, True])
def test_torch_cpp_warnings_stay_off_the_terminal_unless_debug(tmp_path, debug):
    """torch's C++ warnings (NCCL's "unbatched P2P op ... lazy initialization" note under --pp, once per
    rank and link) are not printed unless --debug. Without a GPU, the same logging path is shown by
    c10d's warning when a store client cannot connect yet; ranks inherit the setting."""
    code = ("import sys, datetime; from pipeline.cli import main; main(sys.argv[1:]); "
            "import torch.distributed as dist\n"
            "try:\n"
            "    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:9', rank=1, world_size=2, "
            "timeout=datetime.timedelta(seconds=1))\n"
            "except Exception as e:\n"
            "    print('refused', type(e).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "ARDIT_DEBUG")}
    args = ["--debug", "sample-data", str(tmp_path / "x.parquet"), "-n", "1"] if debug else \
        ["sample-data", str(tmp_path / "x.parquet"), "-n", "1"]
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert "refused" in proc.stdout, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "[W" in line and "TCPStore" in line]
    assert bool(warnings) == debug, proc.stderr
