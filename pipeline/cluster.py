"""Where and how the steps run on a cluster; shared by the KFP and the Argo definitions.

Several things live here so that KFP, Argo and kfp.local cannot drift apart:
  * the step command lines (``step_command`` + ``step_args``): the argv the containers run;
  * the run parameters (``RUN_PARAMETERS``) and the model / weights-PVC rule;
  * the retry policy (``RetryPolicy``): Argo renders it as a retryStrategy expression, KFP (which
    cannot filter on exit codes) runs it inside the pod through ``pipeline.launch``;
  * ``ClusterSettings``: images, node pools, secret / ConfigMap names, deadlines, fan-out width.
Nothing here imports kfp, hera or kubernetes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# Kubernetes expands $(VAR) in container args from the container's env (the ardit-endpoints
# ConfigMap); pipeline.launch expands what is left (KFP fills parameters in after Kubernetes has
# expanded). So the default store is "the Mooncake store configured for the cluster", protocol
# (tcp / rdma) and RDMA device names included.
KV_STORE_FROM_CONFIGMAP = ("mooncake://$(MC_MASTER_ADDR)?metadata=$(MC_METADATA_SERVER)"
                           "&protocol=$(MC_PROTOCOL)&device=$(MC_DEVICE)")

# Keys of the S3 credentials Secret and of the endpoints ConfigMap; both become env vars of the same name.
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ENDPOINT_KEYS = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "MC_MASTER_ADDR", "MC_METADATA_SERVER", "MC_PROTOCOL",
                 "MC_DEVICE")
# The pod's own IP (downward API): the address a Mooncake client registers for itself.
POD_IP_ENV = "POD_IP"
# Step pods carry this label; the NetworkPolicy lets only them reach the Mooncake servers.
KV_CLIENT_LABEL = ("ardit.io/kv-client", "true")

# The weights PVC is mounted read-only here; with a PVC, `model` must name a checkpoint under it.
WEIGHTS_MOUNT = "/weights"
# NCCL needs far more shared memory than the container runtime's 64 MB default.
SHM_MOUNT = "/dev/shm"
RUN_AS_USER = 10001  # the images' `ardit` user

STEP_MODULES = {
    "shard": "components.shard",
    "ar": "components.ar",
    "dit": "components.dit",
    "summary": "components.summary",
    "sweep": "pipeline.sweep",
}
# Which image runs which step (pipeline.images.IMAGES lists what each image must carry for them).
STEP_IMAGE = {"shard": "tools", "summary": "tools", "ar": "gpu", "dit": "gpu", "sweep": "gpu"}
GPU_STEPS = ("ar", "dit", "sweep")
# Steps that read the model (or its tokenizer): they mount the weights PVC when one is given.
MODEL_STEPS = ("shard", "ar", "dit", "sweep")
LAUNCHER = ["python", "-m", "pipeline.launch"]

# The accuracy sweep reads its spec from a ConfigMap (key spec.yaml) and writes to a PVC.
SWEEP_SPEC = "/spec/spec.yaml"
SWEEP_OUTPUT = "/sweeps"

# Parameters of a batch run (KFP pipeline inputs, Argo workflow parameters) and their defaults as
# strings; None: required. An empty value drops the step flag (pipeline.launch), so the step uses
# its own default: the model's generation config for steps / guidance / bot_task, no quantization.
RUN_PARAMETERS: dict[str, str | None] = {
    "dataset": None,
    "output": None,
    "run_id": None,
    "num_shards": "4",
    "model": "tiny",
    "weights_pvc": "",
    "tensor_parallel_size": "1",
    "pipeline_parallel_size": "1",  # a step pod asks for tensor_parallel_size x pipeline_parallel_size GPUs
    "quantization": "",
    "steps": "",
    "guidance": "",
    "bot_task": "",
    "batch_invariant": "",  # "true": each row's AR alone (bitwise independent of its batch)
    "step_cache": "",  # a threshold: the DiT's approximate first-block step cache (off when empty)
    "kv_store": KV_STORE_FROM_CONFIGMAP,
}
SWEEP_PARAMETERS: dict[str, str | None] = {
    "sweep_id": None,
    "spec_config_map": "ardit-sweep-spec",
    "weights_pvc": "",
    "tensor_parallel_size": "1",
}
# Which parameters each step template takes (besides the fixed ones).
STEP_INPUTS = {
    "shard": ("dataset", "output", "run_id", "num_shards", "kind", "model", "weights_pvc"),
    "ar": ("output", "run_id", "shard", "model", "weights_pvc", "tensor_parallel_size", "pipeline_parallel_size",
           "quantization", "kv_store", "bot_task", "batch_invariant"),
    "dit": ("output", "run_id", "shard", "model", "weights_pvc", "tensor_parallel_size", "pipeline_parallel_size",
            "quantization", "kv_store", "steps", "guidance", "step_cache"),
    "summary": ("output", "run_id"),
    "sweep": ("sweep_id", "weights_pvc", "tensor_parallel_size"),
}


def check_model_and_weights(model: str, weights_pvc: str) -> None:
    """A weights PVC and the model must go together: never the tiny preset on real weights.

    Raises ValueError with a one-line message saying what to pass instead.
    """
    reads_pvc = model == WEIGHTS_MOUNT or model.startswith(WEIGHTS_MOUNT + "/")
    if weights_pvc and not reads_pvc:
        raise ValueError(f"weights_pvc={weights_pvc!r} is mounted at {WEIGHTS_MOUNT} but model={model!r} does not "
                         f"load from it: pass model={WEIGHTS_MOUNT} (checkpoint at the PVC root) or "
                         f"model={WEIGHTS_MOUNT}/<checkpoint directory>")
    if reads_pvc and not weights_pvc:
        raise ValueError(f"model={model!r} reads the weights PVC but weights_pvc is empty: pass weights_pvc=<PVC name>")


@dataclass(frozen=True)
class RetryPolicy:
    """One retry policy for both engines: retry failures with exponential backoff, except the exit
    codes no retry can fix (2: usage / config error, caught before any work; the sweep's 1: a gate
    failed, which is its result)."""

    limit: int = 3
    backoff_seconds: int = 30
    factor: int = 2
    max_backoff_seconds: int = 600
    never: tuple[int, ...] = (2,)

    def argo_expression(self) -> str:
        """Retry pod errors (eviction, node loss) and failures with a retryable exit code.

        Argo reports exit code -1 when a pod has none (deadline exceeded, OOM-killed before start)."""
        codes = ", ".join(map(str, self.never))
        return ("lastRetry.status == 'Error' or (lastRetry.status == 'Failed' and "
                f"asInt(lastRetry.exitCode) not in [{codes}])")

    def delays(self, capped: bool = True) -> list[int]:
        """Seconds to wait before retry 1..limit. ``capped=False``: Argo's delays, which keep
        growing past ``max_backoff_seconds`` (Argo 3.6 has no per-delay cap; ``backoff.cap`` is 3.7+)."""
        return [min(d, self.max_backoff_seconds) if capped else d
                for d in (self.backoff_seconds * self.factor ** i for i in range(self.limit))]

    def window_seconds(self, attempt_timeout: int, queue_seconds: int = 0, capped: bool = True) -> int:
        """Seconds from the first attempt's start until the last may end: every attempt at its
        deadline, after waiting up to ``queue_seconds`` unscheduled, plus the backoffs between them.
        Argo's ``backoff.maxDuration`` is this window counted from the first attempt (pending time
        included: a pod's own deadline starts only once a node runs it, so without the queue term
        each wait in a busy GPU queue came off the last attempt). KFP's pod deadline is the window
        without it: KFP retries inside one running pod (``launcher_args``)."""
        return (attempt_timeout + queue_seconds) * (self.limit + 1) + sum(self.delays(capped))

    def launcher_args(self, attempt_timeout: int) -> list[str]:
        """pipeline.launch options that apply this policy inside one pod (KFP)."""
        return ["--retries", str(self.limit), "--backoff", str(self.backoff_seconds), "--backoff-factor",
                str(self.factor), "--backoff-max", str(self.max_backoff_seconds), "--no-retry-exit-codes",
                ",".join(map(str, self.never)), "--attempt-timeout", str(attempt_timeout)]


NO_RETRY_EXIT_CODES = {"sweep": (1, 2)}
DEFAULT_NO_RETRY_EXIT_CODES = (2,)


def step_command(step: str, *, weights_pvc: Any = None, retry: RetryPolicy | None = None,
                 attempt_timeout: int = 0, not_after: Any = None) -> list[str]:
    """The container command of a step: the launcher, then ``python -m <step module>``.

    ``weights_pvc`` (a value or an engine placeholder) turns on the launcher's model / PVC check;
    ``retry`` makes the launcher retry inside the pod (KFP; Argo retries pods itself);
    ``not_after`` (a placeholder; empty at run time: none) is the whole-run deadline of a scheduled
    KFP run, which KFP cannot set on a run (Argo's cron has its workflow deadline).
    """
    options: list[Any] = []
    if weights_pvc is not None:
        options += ["--weights-pvc", weights_pvc]
    if retry is not None:
        options += retry.launcher_args(attempt_timeout)
    if not_after is not None:
        options += ["--not-after", not_after]
    return [*LAUNCHER, *options, "--", "python", "-m", STEP_MODULES[step]]


def step_args(step: str, **values: Any) -> list[Any]:
    """Argv (after ``python -m module``) of a step; values may be KFP placeholders or Argo ``{{...}}`` strings.

    Optional flags are always emitted; the launcher drops those whose value is empty.
    """
    v = values
    if step == "sweep":
        # --resume: a retried or re-submitted sweep keeps the configs that already finished. The
        # spec owns model, tensor parallelism and quantization per config; the pod is sized by
        # the tensor_parallel_size parameter.
        return ["sweep", v["spec"], "--output", v["output"], "--sweep-id", v["sweep_id"], "--resume"]
    common = ["--output", v["output"], "--run-id", v["run_id"]]
    if step == "shard":
        return ["--dataset", v["dataset"], *common, "--num-shards", v["num_shards"], "--kind", v["kind"],
                "--model", v.get("model", "tiny")]
    if step == "summary":
        return common
    if step in ("ar", "dit"):
        args = [*common, "--shard", v["shard"], "--model", v["model"],
                "--tensor-parallel-size", v.get("tensor_parallel_size", 1),
                "--pipeline-parallel-size", v.get("pipeline_parallel_size", 1),
                "--quantization", v.get("quantization", ""), "--kv-store", v["kv_store"]]
        if step == "ar":
            args += ["--bot-task", v.get("bot_task", ""), "--batch-invariant", v.get("batch_invariant", "")]
        else:
            args += ["--steps", v.get("steps", ""), "--guidance", v.get("guidance", ""),
                     "--step-cache", v.get("step_cache", "")]
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
    """A node pool and the resources one step pod asks for there (GPU pods ask for
    ``tensor_parallel_size`` x ``pipeline_parallel_size`` GPUs, run parameters)."""

    cpu: str
    memory: str
    gpu: bool = False
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    shm_size: str = "16Gi"  # memory-backed /dev/shm of GPU pods (counts against the memory limit)


_GPU_TAINT = (Toleration(key="nvidia.com/gpu"),)


def _default_deadlines() -> dict[str, int]:
    # Seconds one attempt of a step may run before it is killed (and retried): one shard's AR or
    # DiT on the full model is hours, not days; the sweep runs every config of its spec.
    return {"shard": 3600, "ar": 6 * 3600, "dit": 6 * 3600, "summary": 1800, "sweep": 12 * 3600}


@dataclass(frozen=True)
class ClusterSettings:
    """Compile-time settings: everything that is a property of the cluster rather than of one run."""

    namespace: str = "ardit"
    service_account: str = "ardit-workflow"
    # Kustomize image names (manifests/images: images/build.sh sets registry and tag). Argo
    # templates keep the names and kustomize rewrites them; KFP needs real references
    # (`ardit compile|submit|schedule --images manifests/images/kustomization.yaml`).
    gpu_image: str = "ardit-gpu"
    tools_image: str = "ardit-tools"
    # AR (prefill + CoT decode) and DiT (denoising) are separate pools so each can be sized for its load.
    ar_pool: Pool = Pool(cpu="8", memory="64Gi", gpu=True, node_selector={"ardit.io/pool": "ar"},
                         tolerations=_GPU_TAINT)
    dit_pool: Pool = Pool(cpu="8", memory="64Gi", gpu=True, node_selector={"ardit.io/pool": "dit"},
                          tolerations=_GPU_TAINT)
    tools_pool: Pool = Pool(cpu="1", memory="4Gi")
    # Secrets (type kubernetes.io/dockerconfigjson) for a private registry, on every pod of both
    # engines; empty: images are public or the nodes can pull them already.
    image_pull_secrets: tuple[str, ...] = ()
    s3_secret: str = "ardit-s3"
    endpoints_config_map: str = "ardit-endpoints"
    sweep_pvc: str = "ardit-sweeps"
    max_parallel_shards: int = 4
    retry: RetryPolicy = RetryPolicy()
    step_deadline_seconds: dict[str, int] = field(default_factory=_default_deadlines)
    # How long one Argo attempt may wait unscheduled (a busy GPU queue) that its retry window still
    # allows for: Argo's window counts pending time, the attempt's own deadline does not.
    attempt_queue_seconds: int = 3600
    workflow_deadline_seconds: int = 48 * 3600
    cron_dataset: str = "s3://ardit/prompts/daily.parquet"
    cron_output: str = "s3://ardit/generated"
    cron_schedule: str = "0 2 * * *"
    cron_timezone: str = "UTC"
    cron_starting_deadline_seconds: int = 3600
    # A scheduled run must end before the next slot (concurrencyPolicy Forbid skips slots while
    # one runs): keep this below the schedule's period.
    cron_deadline_seconds: int = 23 * 3600
    # Run parameters of the scheduled run (a cron takes no -p): model, weights_pvc, steps, ...
    cron_arguments: dict[str, str] = field(default_factory=dict)
    # Shipped suspended: resume once the dataset exists (docs/deploy.md).
    cron_suspended: bool = True
    # RDMA for the KV cache (docs/deploy.md section 11): the RDMA device plugin's resource, e.g.
    # "rdma/hca_shared_devices_a". Set, each GPU step pod (AR, DiT, sweep; never shard or summary)
    # asks for one and gets IPC_LOCK for memory registration, which the namespace must allow
    # (manifests/rdma). Argo only: KFP cannot add a capability to its task pods.
    rdma_resource: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.step_deadline_seconds) - set(STEP_MODULES)
        if unknown:
            raise ValueError(f"step_deadline_seconds: unknown steps {sorted(unknown)}; known: {sorted(STEP_MODULES)}")
        fixed = {"dataset", "output", "run_id"}
        bad = set(self.cron_arguments) - (set(RUN_PARAMETERS) - fixed)
        if bad:
            raise ValueError(f"cron_arguments: unknown or fixed parameters {sorted(bad)} (dataset/output are "
                             f"cron_dataset/cron_output; run_id comes from the slot time)")
        args = self.cron_parameters()
        check_model_and_weights(args["model"] or "", args["weights_pvc"] or "")

    def deadline(self, step: str) -> int:
        return self.step_deadline_seconds.get(step, _default_deadlines()[step])

    def retry_policy(self, step: str) -> RetryPolicy:
        return dataclasses.replace(self.retry, never=NO_RETRY_EXIT_CODES.get(step, DEFAULT_NO_RETRY_EXIT_CODES))

    def cron_parameters(self) -> dict[str, str | None]:
        """Workflow arguments of the scheduled run (no run_id: it comes from the slot time)."""
        params = {k: v for k, v in RUN_PARAMETERS.items() if k != "run_id"}
        return params | {"dataset": self.cron_dataset, "output": self.cron_output} | dict(self.cron_arguments)

    def with_images(self, images: dict[str, str]) -> ClusterSettings:
        """These settings with the image names replaced by the references in ``images`` (name -> ref)."""
        return dataclasses.replace(self, gpu_image=images.get(self.gpu_image, self.gpu_image),
                                   tools_image=images.get(self.tools_image, self.tools_image))

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSettings:
        """Read overrides from YAML (same field names; pools and retry as mappings, tolerations as lists)."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown cluster settings in {path}: {sorted(unknown)}")
        for name in ("ar_pool", "dit_pool", "tools_pool"):
            if name in raw:
                pool = dict(raw[name])
                pool["tolerations"] = tuple(Toleration(**t) for t in pool.get("tolerations", ()))
                raw[name] = Pool(**pool)
        if "retry" in raw:
            retry = dict(raw["retry"])
            if "never" in retry:
                retry["never"] = tuple(retry["never"])
            raw["retry"] = RetryPolicy(**retry)
        if "image_pull_secrets" in raw:
            raw["image_pull_secrets"] = tuple(raw["image_pull_secrets"])
        if "step_deadline_seconds" in raw:
            raw["step_deadline_seconds"] = _default_deadlines() | dict(raw["step_deadline_seconds"])
        return cls(**{k: v for k, v in raw.items()})


def read_kustomize_images(path: str | Path) -> dict[str, str]:
    """``{name: newName:newTag}`` from the ``images:`` of a kustomization / component file."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    out = {}
    for entry in doc.get("images", []):
        ref = entry.get("newName", entry["name"])
        if entry.get("digest"):
            ref += f"@{entry['digest']}"
        elif entry.get("newTag"):
            ref += f":{entry['newTag']}"
        out[entry["name"]] = ref
    return out


def image_name(ref: str) -> str:
    """The repository's last path component of an image reference: reg:5000/ml/ardit-gpu@sha256:... -> ardit-gpu."""
    ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def pin_images(obj: Any, images: dict[str, str]) -> int:
    """Replace, in place, every ``image:`` of ``obj`` whose name (``image_name``) is a key of
    ``images`` (kustomize name -> reference) by that reference; returns how many were replaced.

    For objects already in the cluster with older references: the CronWorkflow, created once and
    never re-applied (its live state, suspend included, must stay as the operator left it)."""
    count = 0
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "image" and isinstance(value, str) and image_name(value) in images:
                obj[key] = images[image_name(value)]
                count += 1
            else:
                count += pin_images(value, images)
    elif isinstance(obj, list):
        count += sum(pin_images(item, images) for item in obj)
    return count


def unresolved_images(settings: ClusterSettings) -> list[str]:
    """Image settings still at a bare kustomize name (no registry, no tag): not pullable as such."""
    return [f"{k}={v}" for k, v in (("gpu_image", settings.gpu_image), ("tools_image", settings.tools_image))
            if "/" not in v and ":" not in v]
