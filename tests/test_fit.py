"""The fit check before loading (components/fit.py) and the GPU arithmetic of a local job's layout.

Numbers it must reproduce (full-size model, docs/benchmarks.md, 2026-11-24, one H200): FP8 weights
88.8 GB; peak 103.5 GB (DiT, one 1024^2 IT2I row, 320 CoT tokens) and 107.7 GB (AR batch 8); bf16
about 160 GB. FP8 on one 80 GB H100 must not fit and must name --tp 2 / --pp 2.
"""

from __future__ import annotations

import pytest

from components.errors import ConfigError
from components.fit import CUDA_CONTEXT_BYTES, DTYPE_BYTES, check_fit, estimate, replicated_parameter_bytes
from components.models import describe_model
from components.preflight import parallel_layout

MODEL = "hunyuan-image-3"
GB = 1e9
H100_FREE = 79e9  # an idle 80 GB H100 (mem_get_info)
H200_FREE = 140e9


@pytest.fixture(scope="module")
def full():
    return describe_model(MODEL)[1], replicated_parameter_bytes(MODEL)


def test_fp8_weights_and_peaks_match_the_h200_measurement(full):
    config, replicated = full
    one_row = estimate(config, replicated, quantization="fp8", batch_size=1, max_new_tokens=160)
    assert one_row.weights / GB == pytest.approx(88.8, abs=0.5)
    assert (one_row.total - CUDA_CONTEXT_BYTES) / GB == pytest.approx(103.5, rel=0.05)
    batch8 = estimate(config, replicated, quantization="fp8", batch_size=8, max_new_tokens=160)
    assert (batch8.total - CUDA_CONTEXT_BYTES) / GB == pytest.approx(107.7, rel=0.05)


def test_bf16_is_about_160_gb_and_halves_per_gpu_at_tp2_or_pp2(full):
    config, replicated = full
    bf16 = estimate(config, replicated).weights
    assert 155 * GB < bf16 < 175 * GB
    for layout in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        half = estimate(config, replicated, **layout).weights
        assert half < 0.55 * bf16  # replicated parts (VAE, ViT, embeddings) stay whole


def test_fp8_fits_one_h200_but_bf16_does_not():
    assert check_fit(MODEL, [H200_FREE], quantization="fp8").total < H200_FREE
    with pytest.raises(ConfigError, match=r"--quantization fp8 \(1 GPU\)") as e:
        check_fit(MODEL, [H200_FREE])
    assert "--quantization fp8 (1 GPU)" in str(e.value) and "\n" not in str(e.value)


def test_fp8_on_one_h100_does_not_fit_and_names_tp2_and_pp2():
    with pytest.raises(ConfigError, match="does not fit") as e:
        check_fit(MODEL, [H100_FREE], quantization="fp8", gpus_visible=1)
    message = str(e.value)
    assert "does not fit" in message and "79 GB free" in message
    assert "--pp 2 or --tp 2 (2 GPUs)" in message and "this machine has 1 GPU(s)" in message
    assert check_fit(MODEL, [H100_FREE] * 2, quantization="fp8", tensor_parallel_size=2).total < H100_FREE
    assert check_fit(MODEL, [H100_FREE] * 2, quantization="fp8", pipeline_parallel_size=2).total < H100_FREE


def test_bf16_on_h100s_names_fp8_at_two_gpus_and_bf16_at_four():
    with pytest.raises(ConfigError, match=r"--tp 2 --quantization fp8 \(2 GPUs\)") as e:
        check_fit(MODEL, [H100_FREE])
    message = str(e.value)
    assert "--pp 2 --quantization fp8 or --tp 2 --quantization fp8 (2 GPUs)" in message
    assert "--pp 4 or --tp 2 --pp 2 or --tp 4 (4 GPUs)" in message


def test_the_tiny_model_fits_anywhere():
    assert check_fit("tiny", [2e9]).total < 2e9


@pytest.mark.parametrize("gpus,tp,pp,dp,want", [
    (8, 1, 1, None, 8), (8, 2, 1, None, 4), (8, 2, 2, None, 2), (8, 1, 2, 3, 3), (2, 2, 1, None, 1),
    (3, 2, 1, None, 1),  # a third GPU that no model copy can use stays idle
])
def test_data_parallel_size_defaults_to_what_the_gpus_hold(gpus, tp, pp, dp, want):
    assert parallel_layout("cuda", tp, pp, dp, gpus) == want


@pytest.mark.parametrize("device,gpus,tp,pp,dp,needle", [
    ("cuda", 8, 2, 1, 5, "--data-parallel-size 5 x --tp 2 needs 10 GPUs, this machine has 8 (at most --dp 4)"),
    ("cuda", 2, 2, 2, None, "--tp 2 x --pp 2 needs 4 GPUs per model copy, this machine has 2"),
    ("cuda:1", 8, 1, 1, 2, "--device cuda:1 is one GPU"),
    ("cpu", None, 1, 0, None, "--pipeline-parallel-size 0: must be a whole number >= 1"),
    ("cpu", None, 1, 1, 0, "--data-parallel-size 0: must be a whole number >= 1"),
])
def test_layouts_the_machine_cannot_hold_are_one_line(device, gpus, tp, pp, dp, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parallel_layout(device, tp, pp, dp, gpus)


def test_cpu_takes_replicas_only_when_asked():
    assert parallel_layout("cpu", 1, 1, None, None) == 1
    assert parallel_layout("cpu", 1, 1, 3, None) == 3


def test_cli_a_layout_that_does_not_fit_is_one_line_exit_2_before_any_work(tmp_path, monkeypatch, capfd):
    from components.data.sample import write_sample_edit_dataset
    from pipeline import cli

    data = write_sample_edit_dataset(tmp_path / "edit.parquet", n=1)
    out = tmp_path / "out"
    monkeypatch.setenv("ARDIT_FAKE_GPU_MEMORY", "80e9x1")  # test-only: one idle 80 GB GPU
    rc = cli.main(["edit", str(data), "-o", str(out), "--run-id", "r", "--model", MODEL, "--quantization", "fp8",
                   "--device", "cpu"])
    captured = capfd.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and len(err) == 1, captured.err
    assert err[0].startswith("ardit: error: --model hunyuan-image-3 does not fit at --tp 1 --pp 1 --quantization fp8")
    assert "--pp 2 or --tp 2 (2 GPUs)" in err[0]
    assert captured.out == "" and not (out / "r").exists()  # nothing started, nothing written
    monkeypatch.setenv("ARDIT_FAKE_GPU_MEMORY", "eighty")
    assert cli.main(["edit", str(data), "-o", str(out), "--device", "cpu"]) == 2
    assert "ARDIT_FAKE_GPU_MEMORY='eighty'" in capfd.readouterr().err


def test_a_big_batch_size_cap_is_not_refused_where_one_row_fits(tmp_path, monkeypatch, capfd):
    """--batch-size is a cap (the AR scheduler admits what fits and halves on OOM): the fit check asks
    one row only. On one H200 (150 GB free) the FP8 model with --batch-size 40 passes the check (it
    was refused as "batch 40 needs 177 GB" on 2026-11-26), while one 80 GB GPU is refused at any cap."""
    from components.preflight import check_memory

    gen = {"max_new_tokens": 2048, "guidance": 5.0}
    monkeypatch.setenv("ARDIT_FAKE_GPU_MEMORY", "150e9x1")
    check_memory(model=MODEL, device="cuda", gpus=1, data_parallel_size=1, tensor_parallel_size=1,
                 pipeline_parallel_size=1, quantization="fp8", weights=None, dtype=None, kind="edit", generation=gen)
    monkeypatch.setenv("ARDIT_FAKE_GPU_MEMORY", "80e9x1")
    with pytest.raises(ConfigError, match=r"\(one row at a time\)"):
        check_memory(model=MODEL, device="cuda", gpus=1, data_parallel_size=1, tensor_parallel_size=1,
                     pipeline_parallel_size=1, quantization="fp8", weights=None, dtype=None, kind="edit",
                     generation=gen)


@pytest.mark.parametrize("option", ["--pp", "--dp"])
def test_cli_pp_and_dp_must_be_positive(tmp_path, capfd, option):
    from components.data.sample import write_sample_edit_dataset
    from pipeline import cli

    data = write_sample_edit_dataset(tmp_path / "edit.parquet", n=1)
    assert cli.main(["edit", str(data), "-o", str(tmp_path / "out"), "--device", "cpu", option, "0"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be a whole number >= 1" in err[0]


def test_the_free_memory_probe_says_what_it_cannot_tell(monkeypatch):
    """The early probe (a child process asking torch) gives [] for GPUs it does not see, so the job
    goes on unchecked rather than failing; it is not started for the CPU or for pretend GPUs."""
    from components.fit import FreeMemoryProbe

    assert FreeMemoryProbe.start("cpu") is None
    monkeypatch.setenv("ARDIT_FAKE_GPU_MEMORY", "80e9x2")
    assert FreeMemoryProbe.start("cuda") is None
    probe = FreeMemoryProbe()  # on this machine's GPUs, if any: free bytes, one per visible device
    import torch

    seen = probe.result(list(range(torch.cuda.device_count())))
    assert len(seen) == torch.cuda.device_count() and all(v > 0 for v in seen)
    assert FreeMemoryProbe().result([torch.cuda.device_count()]) == []  # a GPU it does not see
    slow = FreeMemoryProbe()
    slow.cancel()
    assert slow.proc.returncode is not None


@pytest.mark.parametrize("model", ["tiny", MODEL])
def test_the_vit_is_counted_as_built_and_the_check_imports_no_transformers(model):
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from components.engine.transformer import HunyuanImage3ForCausalMM
    from components.engine.vit import build_vision_model, vision_parameter_count

    config = describe_model(model)[1]
    with torch.device("meta"):
        tower = build_vision_model(config.vit)
        whole = HunyuanImage3ForCausalMM(config.replace(num_hidden_layers=0))
    assert vision_parameter_count(config.vit) == sum(p.numel() for p in tower.parameters())
    # the same bytes as the whole model built on the meta device (the way it was counted before)
    built = sum(p.numel() * DTYPE_BYTES[config.vae_dtype if name.startswith("vae.") else config.torch_dtype]
                for name, p in whole.named_parameters())
    assert replicated_parameter_bytes(model) == built
    code = ("import sys; from components.fit import replicated_parameter_bytes; "
            f"replicated_parameter_bytes({model!r}); print('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[1])).stdout.strip() == "False"


def test_the_full_model_on_a_cpu_is_one_line_before_loading(tmp_path, monkeypatch, capfd):
    """On --device cpu the weights of every process are held to the host memory available: the
    full-size model on a 24 GB machine was killed by the OOM killer partway through its load, with
    no word of why. The tiny model passes; a host with room passes too."""
    from components import fit
    from components.data.sample import write_sample_edit_dataset
    from components.preflight import check_memory
    from pipeline import cli

    monkeypatch.delenv("ARDIT_FAKE_GPU_MEMORY", raising=False)
    monkeypatch.setattr(fit, "available_host_memory", lambda: 24e9)
    data = write_sample_edit_dataset(tmp_path / "edit.parquet", n=1)
    out = tmp_path / "out"
    rc = cli.main(["edit", str(data), "-o", str(out), "--run-id", "r", "--model", MODEL, "--dummy-weights",
                   "--quantization", "fp8", "--device", "cpu"])
    captured = capfd.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and len(err) == 1, captured.err
    assert err[0].startswith("ardit: error: --model hunyuan-image-3 on --device cpu needs about 8")  # ~85 GB
    assert "24 GB available" in err[0] and "--model tiny" in err[0]
    assert not (out / "r").exists()

    gen = {"max_new_tokens": 2048, "guidance": 5.0}
    layout = dict(device="cpu", gpus=None, pipeline_parallel_size=1, weights=None, dtype=None, kind="edit",
                  generation=gen)
    check_memory(model="tiny", data_parallel_size=4, tensor_parallel_size=2, quantization=None, **layout)
    with pytest.raises(ConfigError, match=r"about 17\d GB .*\(2 process\(es\)\)"):  # bf16 at TP2: 2 x ~88 GB
        check_memory(model=MODEL, data_parallel_size=1, tensor_parallel_size=2, quantization=None, **layout)
    monkeypatch.setattr(fit, "available_host_memory", lambda: 2e12)  # a host with 2 TB
    check_memory(model=MODEL, data_parallel_size=1, tensor_parallel_size=1, quantization="fp8", **layout)
