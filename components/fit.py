"""Will the model fit? Per-GPU memory of a layout, estimated before any weight is loaded.

    weights    decoder layers / pp per GPU; attention, experts and shared/dense MLPs / tp; router
               and norms replicated; FP8 (--quantization fp8): those linears at 1 byte + one fp32
               scale per output row. Embeddings, lm_head, VAE (in its own dtype), ViT and the
               image heads are replicated on every GPU (counted from the layer-less model built
               on the meta device: exact, no memory).
    K/V        the planned AR batch: rows x (prompt + CoT budget) tokens, this GPU's layers and KV
               heads; the DiT's CFG rows x (prompt + CoT + image) tokens.
    activations the largest forward (the AR prefill of the batch, or the DiT's CFG rows of image
               tokens) plus a workspace for the image stages (ViT / VAE at the base image size).

The activation constants are calibrated on the full-size model in FP8 on one H200 (the peaks of
its AR and DiT steps, docs/benchmarks.md "The full 80B model in FP8 on one H200"). The estimate is meant to say "no" early and name a
layout that fits, not to size batches (the AR step does that once the weights are loaded).

`check_fit` is called by the job's preflight on CUDA with the free memory of each GPU a model copy
would use; on the CPU, `check_host_fit` holds the processes' weights to the host memory available.
ARDIT_FAKE_GPU_MEMORY="80e9x2" (test-only) pretends the machine has 2 GPUs with 80 GB free each, so
the check and the GPU-count arithmetic can be tested on a machine without GPUs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from components.errors import ConfigError

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# calibration (see the module docstring)
ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN = 35.0  # 143 KB a token of the largest forward at hidden 4096
AR_WORKSPACE_BYTES = 7.1e9  # ViT + VAE encode of a 1024^2 image, compiled-kernel workspaces
DIT_WORKSPACE_BYTES = 11.0e9  # VAE decode of a 1024^2 image, attention workspaces
CUDA_CONTEXT_BYTES = 1.0e9  # CUDA context and allocator slack, outside torch's own peak
PROMPT_TEXT_TOKENS = 256  # instruction + system prompt budget of a planned row
FAKE_GPU_ENV = "ARDIT_FAKE_GPU_MEMORY"


@dataclass
class Estimate:
    weights: float
    kv: float
    activations: float
    context: float = CUDA_CONTEXT_BYTES

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.activations + self.context


@lru_cache(maxsize=4)
def replicated_parameter_bytes(model: str, dtype: str | None = None) -> int:
    """Bytes of everything outside the decoder layers (every GPU holds them), in their dtypes."""
    import torch

    from components.engine.transformer import HunyuanImage3ForCausalMM
    from components.engine.vae import build_vae
    from components.engine.vit import LightProjector, vision_parameter_count
    from components.models import describe_model

    config = describe_model(model)[1]
    model_bytes = DTYPE_BYTES[dtype or config.torch_dtype]
    with torch.device("meta"):  # the ViT tower is counted, not built (no transformers import)
        net = HunyuanImage3ForCausalMM(config.replace(num_hidden_layers=0), with_conditioning=False)
        vae = build_vae(config.vae)
        aligner = LightProjector(config.vit.hidden_size, config.hidden_size, config.vit.aligner_depth)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    return ((count(net) + count(aligner) + vision_parameter_count(config.vit)) * model_bytes
            + count(vae) * DTYPE_BYTES[config.vae_dtype])


def layer_weight_bytes(config: Any, index: int, tp: int, model_bytes: int, fp8: bool) -> float:
    """One decoder layer's bytes on one GPU of a tensor-parallel group of `tp`."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    linears: list[tuple[float, float]] = [  # (parameters, output rows) per GPU
        (h * (heads + 2 * kv) * d / tp, (heads + 2 * kv) * d / tp),  # qkv_proj
        (heads * d * h / tp, h),  # o_proj (row parallel: its output rows stay whole)
    ]
    replicated = 2 * h + 2 * d  # norms
    if config.is_moe_layer(index):
        experts, inter = config.layer("num_experts", index), config.layer("moe_intermediate_size", index)
        linears.append((experts * 3 * h * inter / tp, experts * (2 * inter + h) / tp))
        if config.use_mixed_mlp_moe:
            shared = config.layer("num_shared_expert", index)
            linears.append((shared * 3 * h * inter / tp, shared * (2 * inter + h)))
        replicated_fp32 = h * experts  # the router stays fp32
    else:
        linears.append((3 * h * config.intermediate_size / tp, 2 * config.intermediate_size / tp + h))
        replicated_fp32 = 0
    if fp8:
        stored = sum(n * 1 + rows * 4 for n, rows in linears)
    else:
        stored = sum(n * model_bytes for n, _ in linears)
    return stored + replicated * model_bytes + replicated_fp32 * 4


def planned_tokens(config: Any, kind: str, max_new_tokens: int) -> tuple[int, int, int]:
    """(prompt, CoT budget, image) tokens of a planned row: an edit row brings one conditioning
    image at the base size (its VAE and ViT tokens); the CoT budget counts two stages."""
    image = (config.image_base_size // (config.vae.ffactor_spatial * config.patch_size)) ** 2
    prompt = PROMPT_TEXT_TOKENS + ((image + config.vit.max_num_patches) if kind == "edit" else 0)
    return prompt, 2 * max_new_tokens, image


def estimate(config: Any, replicated_bytes: float, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
             quantization: str | None = None, dtype: str | None = None, batch_size: int = 8, kind: str = "edit",
             max_new_tokens: int = 2048, cfg_rows: int = 2) -> Estimate:
    """Per-GPU bytes of one model copy at tp x pp (the most loaded GPU: the first stage)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    model_bytes = DTYPE_BYTES[dtype or config.torch_dtype]
    layers = math.ceil(config.num_hidden_layers / pp)
    weights = replicated_bytes + sum(layer_weight_bytes(config, i, tp, model_bytes, quantization == "fp8")
                                     for i in range(layers))
    kv_heads = max(1.0, config.num_key_value_heads / tp)
    kv_per_token = 2 * layers * kv_heads * config.head_dim * model_bytes
    prompt, cot, image = planned_tokens(config, kind, max_new_tokens)
    ar_kv = batch_size * (prompt + cot) * kv_per_token
    dit_kv = cfg_rows * (prompt + cot + image) * kv_per_token
    per_token = ACTIVATION_BYTES_PER_TOKEN_AND_HIDDEN * config.hidden_size
    scale = (config.image_base_size / 1024) ** 2
    ar = AR_WORKSPACE_BYTES * scale + per_token * batch_size * prompt + ar_kv
    dit = DIT_WORKSPACE_BYTES * scale + per_token * cfg_rows * image + dit_kv
    kv = ar_kv if ar >= dit else dit_kv
    return Estimate(weights=weights, kv=kv, activations=max(ar, dit) - kv)


def layouts_that_fit(config: Any, replicated_bytes: float, free_bytes: float, *, tensor_parallel_size: int = 1,
                     pipeline_parallel_size: int = 1, quantization: str | None = None, **planned: Any) -> list[str]:
    """The nearest layouts (--tp / --pp doubled or quadrupled, with or without --quantization fp8)
    whose estimate fits `free_bytes`: per choice of quantization the ones with the fewest GPUs,
    fewest first, each as the flags to add and its GPU count. Among as many GPUs, more pipeline
    stages come first: for batch jobs they were the faster layout (2 x H100, FP8: `--pp 2` 458
    img/GPU-h end to end, `--tp 2` 184; docs/benchmarks.md)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    best: dict[str | None, list[tuple[int, str]]] = {}
    for quant in dict.fromkeys([quantization, "fp8"]):
        for t, p in ((tp, pp), (tp, 2 * pp), (2 * tp, pp), (tp, 4 * pp), (2 * tp, 2 * pp), (4 * tp, pp)):
            if (t, p, quant) == (tp, pp, quantization) or p > config.num_hidden_layers:
                continue
            need = estimate(config, replicated_bytes, tensor_parallel_size=t, pipeline_parallel_size=p,
                            quantization=quant, **planned).total
            if need > free_bytes:
                continue
            flags = ([f"--tp {t}"] * (t != tp) + [f"--pp {p}"] * (p != pp)
                     + ["--quantization fp8"] * (quant != quantization))
            found = best.setdefault(quant, [])
            if not found or t * p == found[0][0]:
                found.append((t * p, " ".join(flags)))
    groups = sorted(best.values(), key=lambda g: g[0][0])
    return [f"{' or '.join(flags for _, flags in g)} ({g[0][0]} GPU{'s' if g[0][0] > 1 else ''})" for g in groups]


def _layout_flags(tp: int, pp: int, quantization: str | None) -> str:
    return f"--tp {tp} --pp {pp}" + (" --quantization fp8" if quantization == "fp8" else "")


def check_fit(model: str, free_bytes: list[float], *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
              quantization: str | None = None, dtype: str | None = None, kind: str = "edit",
              max_new_tokens: int = 2048, cfg_rows: int = 2, gpus_visible: int | None = None) -> Estimate:
    """ConfigError (one line: what is needed, what is free, which layouts would fit) when the
    estimate of one model copy running one row at a time exceeds the smallest free memory of the
    GPUs it would use. One row: --batch-size is a cap, the AR's scheduler admits what the memory
    left after the weights holds (ar_scheduler.Admission) and halves on OOM."""
    from components.models import describe_model

    config = describe_model(model)[1]
    replicated = replicated_parameter_bytes(model, dtype)
    planned = dict(dtype=dtype, batch_size=1, kind=kind, max_new_tokens=max_new_tokens, cfg_rows=cfg_rows)
    need = estimate(config, replicated, tensor_parallel_size=tensor_parallel_size,
                    pipeline_parallel_size=pipeline_parallel_size, quantization=quantization, **planned)
    free = min(free_bytes)
    if need.total <= free:
        return need
    fits = layouts_that_fit(config, replicated, free, tensor_parallel_size=tensor_parallel_size,
                            pipeline_parallel_size=pipeline_parallel_size, quantization=quantization, **planned)
    layout = _layout_flags(tensor_parallel_size, pipeline_parallel_size, quantization)
    have = f"; this machine has {gpus_visible} GPU(s)" if gpus_visible is not None else ""
    hint = (f"what would fit: {'; or '.join(fits)}{have}" if fits else
            "no layout up to 4x the GPUs fits: use GPUs with more memory")
    raise ConfigError(
        f"--model {model} does not fit at {layout} (one row at a time): it needs about {need.total / GB:.0f} GB "
        f"per GPU (weights {need.weights / GB:.0f} GB, K/V {need.kv / GB:.0f} GB, activations "
        f"{(need.activations + need.context) / GB:.0f} GB) and the GPU has {free / GB:.0f} GB free; {hint}")


def available_host_memory() -> float | None:
    """Bytes the host can still give this job: /proc/meminfo's MemAvailable, or a cgroup v2 limit
    less its use where that is lower; None where neither can be read (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, float(limit) - float((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def check_host_fit(model: str, available: float, *, processes: int = 1, tensor_parallel_size: int = 1,
                   pipeline_parallel_size: int = 1, quantization: str | None = None, dtype: str | None = None) -> None:
    """ConfigError (one line) when the weights of a CPU job's processes alone exceed the host memory
    available: the full-size model on a CPU is otherwise killed by the kernel's OOM killer partway
    through its load, with no word of why (it happened here: 80B in FP8 on a 24 GB machine)."""
    from components.models import describe_model

    config = describe_model(model)[1]
    per_process = estimate(config, replicated_parameter_bytes(model, dtype), tensor_parallel_size=tensor_parallel_size,
                           pipeline_parallel_size=pipeline_parallel_size, quantization=quantization, dtype=dtype,
                           batch_size=1).weights
    need = per_process * processes
    if need <= available:
        return
    raise ConfigError(
        f"--model {model} on --device cpu needs about {need / GB:.0f} GB of host memory for its weights "
        f"({processes} process(es)) and this machine has {available / GB:.0f} GB available: run it on GPUs "
        "(--device cuda), or use --model tiny to try ardit on a CPU")


def fake_gpus() -> list[float] | None:
    """ARDIT_FAKE_GPU_MEMORY="80e9x2" -> [80e9, 80e9] (test-only: GPUs this machine pretends to have)."""
    spec = os.environ.get(FAKE_GPU_ENV)
    if not spec:
        return None
    try:
        free, _, count = spec.partition("x")
        return [float(free)] * int(count or 1)
    except ValueError:
        raise ConfigError(f"environment variable {FAKE_GPU_ENV}={spec!r}: expected FREE_BYTESxCOUNT, e.g. 80e9x2 "
                          "(test-only; unset it)") from None


class FreeMemoryProbe:
    """Free bytes of every visible GPU, asked by a short child process, so this process never holds a
    CUDA context on GPUs its ranks use. Started early in the job's checks: its own torch import (3.7 s
    on the H100 machine) runs beside theirs."""

    CODE = ("import json,torch; "
            "print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]))")

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)

    @classmethod
    def start(cls, device: str) -> "FreeMemoryProbe | None":
        """A probe where the job may run on NVIDIA GPUs (not for --device cpu or pretend GPUs)."""
        if device == "cpu" or fake_gpus() is not None or not Path("/dev/nvidiactl").exists():
            return None
        return cls()

    def result(self, device_ids: list[int]) -> list[float]:
        """Free bytes of these GPUs; [] when the probe could not tell (then no check: the load will say)."""
        import json
        import subprocess

        try:
            out, _ = self.proc.communicate(timeout=300)
            free = json.loads(out.strip().splitlines()[-1]) if self.proc.returncode == 0 else []
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            self.cancel()
            return []
        return [float(free[i]) for i in device_ids] if all(i < len(free) for i in device_ids) else []

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def free_gpu_memory(device_ids: list[int], in_process: bool, probe: FreeMemoryProbe | None = None) -> list[float]:
    """Free bytes of each GPU. `in_process`: this process will use the GPU itself anyway; otherwise
    a short child process asks (`probe`, if one was started already)."""
    fake = fake_gpus()
    if fake is not None:
        return [fake[i] for i in device_ids]
    if in_process:
        if probe is not None:
            probe.cancel()  # its own CUDA context would count against the free memory read here
        import torch

        return [float(torch.cuda.mem_get_info(i)[0]) for i in device_ids]
    return (probe or FreeMemoryProbe()).result(device_ids)
