"""One validation pass before a job does any work.

Everything a run depends on is checked up front and reported in one line (what, where, how to
fix) as a ConfigError, which every CLI turns into exit code 2. Storage errors that may pass (S3
5xx, timeouts, an unreachable endpoint) are not configuration errors: they propagate (exit 1), so
workflow engines retry them. The cheap checks come first, before torch or the engine is imported
(a mistake there is answered in about a second):

    options          numbers in range, choices (steps >= 1, guidance >= 0, bot_task, dtype, ...)
    model name       a name that is no path nor repo id is a known one (a typo: "did you mean")
    dataset          reachable, Parquet, with the columns of its kind, at least one row
    output           writable (S3: bucket exists, credentials work, a probe object can be written)
    KV store URL     parses; the embedded store's directory can be created
    device           cuda asked for: the machine shows an NVIDIA GPU
then, with the engine's code:
    model            preset / checkpoint directory / HF repo id resolvable, tokenizer loadable, weights
                     present (the index's shards too) unless --dummy-weights
    run              a resumed run id belongs to this dataset and these settings
    device, KV store torch sees the GPU; the KV store's servers answer (mooncake: connect)
    GPUs             dp x tp x pp GPUs exist; one model copy fits each GPU's free memory
                     (components.fit), else what would fit: --tp 2, --pp 2, --quantization fp8

Nothing is created by the checks: the output directory appears once they all passed (a directory
is tested by writing a probe into it, removed at once).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from components.errors import ConfigError, missing_extra
from components.fit import FreeMemoryProbe
from components.jobconfig import JobConfig


def check_dataset(dataset: str, kind: str):
    """The dataset opened (footers only) with the columns `kind` needs; ConfigError otherwise."""
    from components.data.datasets import DatasetError, check_columns, read_dataset
    from components.data.objectstore import BucketNotFoundError, S3AccessError

    try:
        source = read_dataset(dataset)
        check_columns(source, kind)
    except (DatasetError, S3AccessError, BucketNotFoundError, ValueError) as exc:  # not transient ones
        raise ConfigError(f"dataset {dataset}: {exc}") from None
    except ImportError as exc:
        raise (missing_extra(exc, f"dataset {dataset}") or exc) from None
    if source.num_rows == 0:
        raise ConfigError(f"dataset {dataset}: has no rows ({len(source.files)} Parquet file(s), 0 rows); "
                          "point it at a dataset with at least one row")
    return source


def check_output(output: str) -> None:
    """The output root can be written: a directory we can create and write into, or an S3
    prefix whose bucket exists and whose credentials may read, list and write."""
    from components.data.objectstore import (
        BucketNotFoundError,
        ObjectStoreError,
        S3AccessError,
        S3ObjectStore,
        open_object_store,
    )

    try:
        store = open_object_store(output)
    except ValueError as exc:
        raise ConfigError(f"--output {output}: {exc}") from None
    if isinstance(store, S3ObjectStore):
        try:
            store.check_access(write=True)
        except (S3AccessError, BucketNotFoundError) as exc:  # configuration: no retry can fix it
            raise ConfigError(f"--output {output}: {exc}") from None
        except ObjectStoreError as exc:  # 5xx, timeouts, unreachable: may pass, so exit 1 (retried)
            raise ObjectStoreError(f"--output {output}: {exc}; this may pass: run the same command again") from None
        except ImportError as exc:
            raise (missing_extra(exc, f"--output {output}") or exc) from None
        return
    check_creatable_dir(Path(store.root), f"--output {output}")


def check_creatable_dir(path: Path, what: str) -> None:
    """`path` is a writable directory, or one that can be created; nothing is created."""
    path = path.expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what}: {'it' if existing == path else existing} is a file, not a directory")
    # written to, not asked (os.access): root passes every access check, also where nothing can be
    # created (/proc, a read-only mount)
    try:
        probe = Path(tempfile.mkdtemp(prefix=".ardit-probe-", dir=existing))
        try:
            (probe / "probe").write_bytes(b"")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write there ({existing}: {exc.strerror or exc}); choose a directory "
                          "you can write") from None


# the model names of components.engine.resolve (its PRESETS and the installed demo checkpoint), here
# without importing the engine (a test keeps them in step)
MODEL_NAMES = ("tiny", "hunyuan-image-3", "hunyuan-image-3-distil", "demo")


def check_model_name(model: str) -> None:
    """A --model that can only be a model's name (no path, no repo id) is one, else a ConfigError now:
    a typo is answered before torch and the engine are imported, seconds earlier (the full check,
    with checkpoint directories and the Hugging Face cache, is components.models.resolve_model)."""
    import difflib

    path = Path(model).expanduser()
    if path.is_file():
        raise ConfigError(f"--model {model}: is a file, not a checkpoint directory (config.json, *.safetensors, "
                          "tokenizer files) nor a model name")
    if model in MODEL_NAMES or "/" in model or model.startswith((".", "~")) or path.exists():
        return
    close = difflib.get_close_matches(model, MODEL_NAMES, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"--model {model}: unknown model {model!r}: {hint}use one of {', '.join(MODEL_NAMES)}, a "
                      "checkpoint directory or a Hugging Face repo id such as tencent/HunyuanImage-3.0-Instruct")


def check_kv_url(url: str) -> None:
    """The KV store URL parses, and the embedded store's directory can be created (cheap: its
    servers, if any, are asked by check_kv_store)."""
    from components.kvstore.factory import local_path
    from components.kvstore.memory import parse_memory_url

    try:
        path = local_path(url)
        if url.startswith("memory://"):
            parse_memory_url(url)
    except ValueError as exc:
        raise ConfigError(f"--kv-store: {exc}") from None
    if path is not None:
        check_creatable_dir(Path(path), f"--kv-store {url}")


def check_weights(model: str, weights: str | None, dummy_weights: bool) -> None:
    """A checkpoint's safetensors are there (every shard its index names) unless random weights
    were asked for: a download without its weights fails here, not after the run started."""
    from components.engine.weights import CheckpointError, checkpoint_files
    from components.models import resolve_model

    ref = resolve_model(model)
    if dummy_weights or (ref.kind == "preset" and weights is None):
        return
    directory = Path(weights).expanduser() if weights else ref.path
    option = f"--weights {weights}" if weights else f"--model {model}"
    try:
        checkpoint_files(directory)
    except CheckpointError as exc:
        raise ConfigError(f"{option}: {exc}; download the weights (e.g. hf download REPO), or pass "
                          "--dummy-weights for seeded random ones") from None


def check_kv_store(url: str) -> None:
    """The KV store URL parses, its backend is installed and its servers answer."""
    from components.run_kv import open_kv_store

    store = open_kv_store(url)
    try:
        health = store.health()
    except ImportError as exc:
        raise (missing_extra(exc, f"--kv-store {url}") or exc) from None
    finally:
        store.close()
    if not health.ok:
        hint = ("start one with `ardit store up` (it prints the URL), or leave --kv-store out for the "
                "embedded store" if url.startswith("mooncake://") else "check the path")
        raise ConfigError(f"--kv-store {url}: {health.detail}; {hint}")


OVERLAP = ("auto", "on", "off")


def check_overlap(overlap: str, ranks: int) -> None:
    """--overlap is one of OVERLAP, and `on` only where a model copy is one process (tp x pp = 1)."""
    if overlap not in OVERLAP:
        raise ConfigError(f"--overlap {overlap!r}: use one of {', '.join(OVERLAP)}")
    if overlap == "on" and ranks > 1:
        raise ConfigError(f"--overlap on: a model copy of {ranks} ranks (--tp x --pp) runs its AR and DiT steps in "
                          "turn (their collectives would interleave); use --overlap auto or off")


def check_parallel_options(pipeline_parallel_size: int, data_parallel_size: int | None) -> None:
    for option, value in (("--pipeline-parallel-size", pipeline_parallel_size),
                          ("--data-parallel-size", data_parallel_size)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{option} {value!r}: must be a whole number >= 1")


def parallel_layout(device: str, tensor_parallel_size: int, pipeline_parallel_size: int,
                    data_parallel_size: int | None, gpus: int | None) -> int:
    """The data-parallel size of a local job: `data_parallel_size`, or (None) as many model copies
    of tp x pp GPUs as the `gpus` visible GPUs hold (1 on the CPU, and with --device cuda:N).
    ConfigError when the GPUs cannot hold it."""
    check_parallel_options(pipeline_parallel_size, data_parallel_size)
    world = tensor_parallel_size * pipeline_parallel_size
    if not device.startswith("cuda") or gpus is None:
        return data_parallel_size or 1  # CPU: N replicas are N processes
    copy = (f"--tp {tensor_parallel_size}" + (f" x --pp {pipeline_parallel_size}" if pipeline_parallel_size > 1
                                               else ""))
    if device != "cuda":  # cuda:N: that one GPU
        if (data_parallel_size or 1) > 1 or world > 1:
            raise ConfigError(f"--device {device} is one GPU: a job of {copy} x --dp {data_parallel_size or 1} "
                              "takes GPUs from 0 up; use --device cuda")
        return 1
    if world > gpus:
        raise ConfigError(f"{copy} needs {world} GPUs per model copy, this machine has {gpus}")
    fits = gpus // world
    if data_parallel_size is not None and data_parallel_size > fits:
        raise ConfigError(f"--data-parallel-size {data_parallel_size} x {copy} needs {data_parallel_size * world} "
                          f"GPUs, this machine has {gpus} (at most --dp {fits})")
    return data_parallel_size or fits


def check_memory(*, model: str, device: str, gpus: int | None, data_parallel_size: int, tensor_parallel_size: int,
                 pipeline_parallel_size: int, quantization: str | None, weights: str | None, dtype: str | None,
                 kind: str, generation: dict[str, Any], probe: Any = None) -> None:
    """One model copy fits the free memory of every GPU the job uses; on the CPU, the weights of
    all its processes fit the host's memory (components.fit). `probe`: a FreeMemoryProbe started
    earlier, if any."""
    from components.fit import available_host_memory, check_fit, check_host_fit, free_gpu_memory
    from components.models import describe_model

    if not device.startswith("cuda"):
        available = available_host_memory()
        if available is not None:
            processes = data_parallel_size * tensor_parallel_size * pipeline_parallel_size
            check_host_fit(model, available, processes=processes, tensor_parallel_size=tensor_parallel_size,
                           pipeline_parallel_size=pipeline_parallel_size, quantization=quantization, dtype=dtype)
        return
    if weights is not None:
        from components.engine.quant import is_fp8_checkpoint

        quantization = "fp8" if is_fp8_checkpoint(Path(weights).expanduser()) else quantization
    world = tensor_parallel_size * pipeline_parallel_size
    ids = [int(device.partition(":")[2])] if ":" in device else list(range(data_parallel_size * world))
    in_process = data_parallel_size == 1 and world == 1  # this process loads the engine itself
    free = free_gpu_memory(ids, in_process, probe)
    if not free:
        return
    distilled = describe_model(model)[1].cfg_distilled
    check_fit(model, free, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
              quantization=quantization, dtype=dtype, kind=kind, max_new_tokens=generation["max_new_tokens"],
              cfg_rows=1 if distilled or generation["guidance"] <= 1 else 2, gpus_visible=gpus)


def visible_gpus(device: str) -> int | None:
    """GPUs this job may use (None off CUDA); ARDIT_FAKE_GPU_MEMORY (test-only) pretends."""
    from components.fit import fake_gpus

    fake = fake_gpus()
    if fake is not None:
        return len(fake)
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.device_count()


# Rows a shard holds at most under --num-shards auto: its AR batch fills the GPU (about 40 rows of
# 1024x1024 edits in flight on an H200 at FP8), and the K/V it leaves for its DiT step (up to ~0.7 GB
# a row) stays a few tens of GB in the embedded store.
ROWS_PER_SHARD = 64


def auto_num_shards(rows: int, data_parallel_size: int) -> int:
    """--num-shards auto: at least one shard per model copy (every GPU busy) and at most
    ROWS_PER_SHARD rows a shard; 2 for small datasets (as before); never more shards than rows."""
    return max(1, min(rows, max(2, data_parallel_size, -(-rows // ROWS_PER_SHARD))))


def check_job(config: JobConfig) -> dict[str, Any]:
    """Every check of a local job, cheapest first. Returns what the job needs resolved:
    device, data-parallel size, generation settings, the row validators and the settings each
    step remembers."""
    from components.ar.run import ar_settings
    from components.data.runs import RunLayout
    from components.devices import check_cuda_present, resolve_device
    from components.dit.run import dit_settings
    from components.generation import resolve_generation
    from components.models import model_validators
    from components.options import KINDS, check_bench_cot, check_engine_options
    from components.run_kv import job_kv_store
    from components.runtime.layout import check_pipeline_stages, check_tensor_parallel
    from components.shard.run import check_existing, shard_identity

    num_shards, device = config.num_shards, config.device  # resolved below
    if config.kind not in KINDS:
        raise ConfigError(f"kind {config.kind!r}: must be one of {', '.join(KINDS)}")
    if num_shards != "auto" and not (isinstance(num_shards, int) and num_shards >= 1):
        raise ConfigError(f"--num-shards {num_shards!r}: must be auto or a whole number >= 1")
    check_engine_options(dtype=config.dtype, quantization=config.quantization,
                         tensor_parallel_size=config.tensor_parallel_size, seed=config.seed,
                         batch_size=config.batch_size, device=device, step_cache=config.step_cache,
                         pipeline_parallel_size=config.pipeline_parallel_size)
    check_parallel_options(config.pipeline_parallel_size, config.data_parallel_size)
    check_overlap(config.overlap, config.tensor_parallel_size * config.pipeline_parallel_size)
    try:
        layout = RunLayout.open(config.output, config.run_id)  # checks the run id; touches no storage yet
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"--output {config.output}: {exc}") from None
    if config.weights is not None and not Path(config.weights).expanduser().is_dir():
        raise ConfigError(f"--weights {config.weights}: no such directory")
    # cheap checks: no torch, no engine yet
    check_model_name(config.model)
    source = check_dataset(config.dataset, config.kind)
    if num_shards != "auto" and num_shards > source.num_rows:
        raise ConfigError(f"--num-shards {num_shards}: the dataset has {source.num_rows} row(s), so at most "
                          f"{source.num_rows} shard(s) (or auto)")
    check_output(config.output)
    kv_url = (None if not config.kv_reuse or config.ar_from_run else
              job_kv_store(config.output, config.run_id, config.kv_store))
    if kv_url is not None:
        check_kv_url(kv_url)
    check_cuda_present(device)
    probe = FreeMemoryProbe.start(device)  # asks the GPUs' free memory beside the checks below
    try:
        # imports the engine (torch) beside the probe's own
        check_bench_cot(config.model, config.weights, config.dummy_weights)
        # the model: its config, tokenizer and weights files
        gen = resolve_generation(config.model, greedy=config.greedy, **config.generation)  # also resolves the model
        validators = model_validators(config.model)  # its tokenizer and resolution buckets load
        check_weights(config.model, config.weights, config.dummy_weights)
        from components.engine.compile_cache import check_setting  # the engine is imported by now

        if (problem := check_setting()) is not None:
            raise ConfigError(problem)
        if config.pipeline_parallel_size > 1:
            check_pipeline_stages(config.model, config.pipeline_parallel_size)
        check_tensor_parallel(config.model, config.tensor_parallel_size)
        ar = {"ar_from_run": config.ar_from_run} if config.ar_from_run else ar_settings(config, gen)
        dit = dit_settings(config, gen)
        state = layout.state()  # the run's manifest, settings and commits: the job reads them only here
        layout.check_settings("ar", ar, state.settings["ar"])  # a resumed run: same settings, or a clear refusal
        layout.check_settings("dit", dit, state.settings["dit"])
        device = resolve_device(device)
        gpus = visible_gpus(device)
        dp = parallel_layout(device, config.tensor_parallel_size, config.pipeline_parallel_size,
                             config.data_parallel_size, gpus)
        if num_shards == "auto":  # a resumed run keeps its sharding, wherever it resumes
            num_shards = (state.manifest or {}).get("num_shards") or auto_num_shards(source.num_rows, dp)
        manifest = check_existing(layout, shard_identity(config.dataset, source.fingerprint, config.kind, num_shards,
                                                         validators[2]), state.manifest)
        finished = manifest is not None and state.finished
        if not finished:
            check_memory(model=config.model, device=device if gpus is None or device.startswith("cuda") else "cuda",
                         gpus=gpus, data_parallel_size=dp, tensor_parallel_size=config.tensor_parallel_size,
                         pipeline_parallel_size=config.pipeline_parallel_size, quantization=config.quantization,
                         weights=config.weights, dtype=config.dtype, kind=config.kind, generation=gen, probe=probe)
        if kv_url is not None and not finished and kv_url.startswith("mooncake://"):
            check_kv_store(kv_url)  # its servers answer (an embedded store was checked above)
        return {"device": device, "data_parallel_size": dp, "generation": gen, "validators": validators,
                "settings": {"ar": ar, "dit": dit}, "layout": layout, "state": state, "finished": finished,
                "num_shards": num_shards}
    finally:  # on every way out, a refusal before the memory check too (a finished probe: nothing to do)
        if probe is not None:
            probe.cancel()
