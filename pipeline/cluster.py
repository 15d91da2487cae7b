"""Where and how the steps run on a cluster; shared by the KFP and the Argo definitions.

Two things live here so that KFP, Argo and kfp.local cannot drift apart:
  * the step command lines (``step_args``): the same argv the containers run (docs/architecture.md);
  * ``ClusterSettings``: images, node pools, secret / ConfigMap names, retries, fan-out width.
Nothing here imports kfp, hera or kubernetes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# Kubernetes expands $(VAR) in container args from the container's env (which comes from the
# endpoints ConfigMap), so this default means "the KV store configured for the cluster".
KV_STORE_FROM_CONFIGMAP = "$(ARDIT_KV_STORE)"

# Keys of the S3 credentials Secret and of the endpoints ConfigMap; both become env vars of the same name.
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ENDPOINT_KEYS = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "ARDIT_KV_STORE", "MC_MASTER_ADDR", "MC_METADATA_SERVER")
# The pod's own IP (downward API): the address a Mooncake client registers for itself.
POD_IP_ENV = "POD_IP"

STEP_MODULES = {
    "shard": "components.shard",
    "ar": "components.ar",
    "dit": "components.dit",
    "summary": "components.summary",
    "sweep": "components.sweep",
}
# Exit codes that no retry can fix: 2 is a usage / input error for every step; the sweep also
# exits 1 when an accuracy gate fails (its result, not a fault).
NO_RETRY_EXIT_CODES = {"sweep": (1, 2)}
DEFAULT_NO_RETRY_EXIT_CODES = (2,)

# The accuracy sweep reads its spec from a ConfigMap (key spec.yaml) and writes to a PVC.
SWEEP_SPEC = "/spec/spec.yaml"
SWEEP_OUTPUT = "/sweeps"


def step_command(step: str) -> list[str]:
    """The container command of a step (arguments come from ``step_args``)."""
    return ["python", "-m", STEP_MODULES[step]]


def step_args(step: str, **values: Any) -> list[Any]:
    """Argv (after ``python -m module``) of a step; values may be KFP placeholders or Argo ``{{...}}`` strings.

    ``weights=None`` leaves ``--weights`` out (the tiny model then uses a seeded random init).
    """
    v = values
    if step == "sweep":
        # --resume: a retried or re-submitted sweep keeps the configs that already finished.
        return ["sweep", v["spec"], "--output", v["output"], "--sweep-id", v["sweep_id"], "--resume"]
    common = ["--output", v["output"], "--run-id", v["run_id"]]
    if step == "shard":
        return ["--dataset", v["dataset"], *common, "--num-shards", v["num_shards"], "--kind", v["kind"],
                "--model", v.get("model", "tiny")]
    if step == "summary":
        return common
    if step in ("ar", "dit"):
        args = [*common, "--shard", v["shard"], "--model", v["model"]]
        if v.get("weights") is not None:
            args += ["--weights", v["weights"]]
        args += ["--kv-store", v["kv_store"]]
        if step == "dit":
            args += ["--steps", v["steps"], "--guidance", v["guidance"]]
        return args
    raise KeyError(step)


@dataclass(frozen=True)
class Toleration:
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


@dataclass(frozen=True)
class Pool:
    """A node pool and the resources one step pod asks for there."""

    cpu: str
    memory: str
    gpus: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()


_GPU_TAINT = (Toleration(key="nvidia.com/gpu"),)


@dataclass(frozen=True)
class ClusterSettings:
    """Compile-time settings: everything that is a property of the cluster rather than of one run."""

    namespace: str = "ardit"
    service_account: str = "ardit-workflow"
    gpu_image: str = "registry.example.com/ardit-gpu:0.1.0"
    tools_image: str = "registry.example.com/ardit-tools:0.1.0"
    # AR (prefill + CoT decode) and DiT (denoising) are separate pools so each can be sized for its load.
    ar_pool: Pool = Pool(cpu="8", memory="64Gi", gpus=1, node_selector={"ardit.io/pool": "ar"}, tolerations=_GPU_TAINT)
    dit_pool: Pool = Pool(cpu="8", memory="64Gi", gpus=1, node_selector={"ardit.io/pool": "dit"}, tolerations=_GPU_TAINT)
    tools_pool: Pool = Pool(cpu="1", memory="2Gi")
    s3_secret: str = "ardit-s3"
    endpoints_config_map: str = "ardit-endpoints"
    # Checkpoint on a PVC (mounted read-only at weights_path); None: no --weights (tiny model, random init).
    weights_pvc: str | None = None
    weights_path: str = "/weights"
    sweep_pvc: str = "ardit-sweeps"
    max_parallel_shards: int = 4
    retries: int = 3
    backoff: str = "30s"
    backoff_factor: int = 2
    backoff_max: str = "10m"
    cron_dataset: str = "s3://ardit/prompts/daily.parquet"
    cron_output: str = "s3://ardit/generated"
    cron_schedule: str = "0 2 * * *"
    cron_timezone: str = "UTC"
    cron_starting_deadline_seconds: int = 3600

    @property
    def weights(self) -> str | None:
        return self.weights_path if self.weights_pvc else None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSettings:
        """Read overrides from YAML (same field names; pools as mappings, tolerations as lists of mappings)."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown cluster settings in {path}: {sorted(unknown)}")
        for name in ("ar_pool", "dit_pool", "tools_pool"):
            if name in raw:
                pool = dict(raw[name])
                pool["tolerations"] = tuple(Toleration(**t) for t in pool.get("tolerations", ()))
                raw[name] = Pool(**pool)
        return cls(**raw)
