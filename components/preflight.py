"""One validation pass before a job does any work.

Everything a run depends on is checked up front and reported in one line (what, where, how to
fix) as a ConfigError, which every CLI turns into exit code 2. Storage errors that may pass (S3
5xx, timeouts, an unreachable endpoint) are not configuration errors: they propagate (exit 1), so
workflow engines retry them:

    options          numbers in range, choices (steps >= 1, guidance >= 0, bot_task, dtype, ...)
    device           cuda present when asked for; "gpu" suggests "cuda"
    model            preset / checkpoint directory / HF repo id resolvable, tokenizer loadable
    dataset          reachable, Parquet, with the columns of its kind
    output           writable (S3: bucket exists, credentials work, a probe object can be written)
    KV store         URL valid, optional extra installed, servers answer (mooncake: connect)
    run              a resumed run id belongs to this dataset and these settings
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from components.errors import ConfigError, missing_extra


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
    root = Path(store.root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--output {output}: is a file, not a directory")
    probe = root / f".ardit-write-probe-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output {output}: cannot write there ({exc.strerror or exc}); "
                          "choose a directory you can write") from None


def check_kv_store(url: str) -> None:
    """The KV store URL parses, its backend is installed and its servers answer."""
    from components.steps import open_kv_store

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


def check_job(*, dataset: str, output: str, run_id: str, kind: str, num_shards: int, model: str,
              weights: str | None, dummy_weights: bool, tensor_parallel_size: int, quantization: str | None,
              kv_store: str | None, kv_reuse: bool, device: str, dtype: str | None, seed: int, batch_size: int,
              generation: dict[str, Any], greedy: bool = False, ar_from_run: str | None = None,
              step_cache: float = 0.0, batch_invariant: bool = False) -> dict[str, Any]:
    """Every check of a local job, cheapest first. Returns what the job needs resolved:
    device, generation settings, the row validators and the settings each step remembers."""
    from components.ar.run import ar_settings
    from components.data.runs import RunLayout
    from components.dit.run import dit_settings
    from components.shard.run import check_existing, shard_identity
    from components.steps import (
        KINDS,
        check_engine_options,
        default_kv_store,
        model_validators,
        resolve_device,
        resolve_generation,
    )

    if kind not in KINDS:
        raise ConfigError(f"kind {kind!r}: must be one of {', '.join(KINDS)}")
    if not (isinstance(num_shards, int) and num_shards >= 1):
        raise ConfigError(f"--num-shards {num_shards!r}: must be a whole number >= 1")
    check_engine_options(dtype=dtype, quantization=quantization, tensor_parallel_size=tensor_parallel_size,
                         seed=seed, batch_size=batch_size, device=device, step_cache=step_cache)
    try:
        layout = RunLayout.open(output, run_id)  # checks the run id; touches no storage yet
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"--output {output}: {exc}") from None
    if weights is not None and not Path(weights).expanduser().is_dir():
        raise ConfigError(f"--weights {weights}: no such directory")
    gen = resolve_generation(model, greedy=greedy, **generation)  # also resolves the model
    validators = model_validators(model)  # its tokenizer and resolution buckets load
    check_output(output)
    ar = ({"ar_from_run": ar_from_run} if ar_from_run else
          ar_settings(model, weights, dummy_weights, dtype, quantization, seed, gen, batch_invariant))
    dit = dit_settings(model, weights, dummy_weights, dtype, quantization, seed, gen, step_cache)
    layout.check_settings("ar", ar)  # a resumed run: same settings, or a clear refusal
    layout.check_settings("dit", dit)
    source = check_dataset(dataset, kind)
    check_existing(layout, shard_identity(dataset, source.fingerprint, kind, num_shards, validators[2]))
    device = resolve_device(device)
    if kv_reuse and not ar_from_run:
        check_kv_store(kv_store or default_kv_store(output, run_id))
    return {"device": device, "generation": gen, "validators": validators, "settings": {"ar": ar, "dit": dit},
            "layout": layout}
