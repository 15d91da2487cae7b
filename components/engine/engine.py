"""Engine: the model, tokenizer and both stages, loaded once per step process.

    resolve --model (preset | checkpoint directory | Hugging Face repo id)
    config.json -> HunyuanImage3Config;  generation_config.json;  tokenizer;  system_prompt.py
    build the network on the meta device (no memory), slice it for tensor/expert parallelism,
    allocate it on the target device in its dtypes (transformer in the model dtype, router fp32,
    VAE in vae_dtype), then load the safetensors shard by shard (or draw dummy weights)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .ar import ARGenerator, AROutput, ARRequest, SamplingParams
from .ar_scheduler import Admission
from .config import HunyuanImage3Config, get_config
from .dit import DiTGenerator, DiTOutput, DiTRequest
from .quant import is_fp8_checkpoint, load_pretrained_fp8, quantize_model_fp8_
from .resolve import ResolvedModel, resolve_model
from .sequence import SequenceBuilder
from .tokenizer import Tokenizer, load_tokenizer
from .transformer import HunyuanImage3ForCausalMM, TopKGate
from .weights import LoadStats, init_dummy_weights, load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Engine:
    config: HunyuanImage3Config
    model: HunyuanImage3ForCausalMM
    tokenizer: Tokenizer
    builder: SequenceBuilder
    model_id: str
    generation_config: Any = None  # components.engine.generation_config.GenerationConfig
    system_prompts: dict[str, str] | None = None
    load_stats: LoadStats = field(default_factory=LoadStats)
    parallel: Any = None  # components.runtime.parallel.ParallelContext when tensor parallel

    @classmethod
    def load(cls, model: str = "tiny", weights: str | Path | None = None, device: str = "cpu",
             dtype: str | None = None, seed: int = 0, dummy_weights: bool = False,
             tensor_parallel_size: int = 1, quantization: str | None = None,
             moe_drop_tokens: bool = False, parallel: Any = None,
             pipeline_parallel_size: int = 1) -> "Engine":
        """`model`: a preset, a checkpoint directory or a Hugging Face repo id (local cache only).

        weights: where the safetensors live when not beside config.json. Presets and
        dummy_weights=True draw seeded random weights instead (the `dummy` load format).
        parallel: this rank's ParallelContext when the step runs tensor / pipeline parallel (the
        launcher creates it); tensor_parallel_size and pipeline_parallel_size must match it.
        """
        resolved = resolve_model(model)
        config, tokenizer, generation_config, system_prompts = describe(resolved)
        if dtype:
            config = config.replace(torch_dtype=dtype)
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, config vocab is {config.vocab_size}")
        if tensor_parallel_size > 1 and (parallel is None or parallel.world_size != tensor_parallel_size
                                         and not parallel.cfg_parallel):
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs the launcher's process group "
                             "(run the step program with --tensor-parallel-size, it starts the ranks)")
        if pipeline_parallel_size != (1 if parallel is None else parallel.pp_size):
            raise ValueError(f"pipeline_parallel_size {pipeline_parallel_size} needs the launcher's process group "
                             "(run the step program with --pipeline-parallel-size, it starts the ranks)")
        if quantization not in (None, "", "none", "fp8"):
            raise ValueError(f"quantization {quantization!r}: supported is fp8")
        if config.torch_dtype == "float32" and device != "cpu":
            # cuDNN convolutions default to TF32; its rounding is discontinuous, so tiny input
            # differences jump to ~1e-3 and grow through CFG. float32 must mean float32.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False

        net = build_model(config, device, parallel=parallel, allocate=False)
        weights_dir = None if dummy_weights else Path(weights) if weights else resolved.path
        if weights_dir is not None and is_fp8_checkpoint(weights_dir):  # stored as E4M3 + scales
            quantization = "fp8"
            quantize_model_fp8_(net)
            net.to_empty(device=device)
            load_pretrained_fp8(net, weights_dir)
            stats = LoadStats()
        else:
            stats = materialize(net, device, weights_dir, seed, quantize=quantization == "fp8")
        net.quantization = quantization if quantization == "fp8" else None
        for i in net.stage_layers:
            layer = net.model.layers[i]
            if hasattr(layer.mlp, "drop_tokens"):
                layer.mlp.drop_tokens = moe_drop_tokens
        net.eval()
        builder = SequenceBuilder.from_config(tokenizer, config, generation_config)
        return cls(config, net, tokenizer, builder, resolved.name, generation_config, system_prompts, stats,
                   parallel)

    @cached_property
    def ar(self) -> ARGenerator:
        return ARGenerator(self.model, self.tokenizer, self.builder, self.model_id, self.generation_config,
                           self.system_prompts)

    @cached_property
    def dit(self) -> DiTGenerator:
        return DiTGenerator(self.model, self.builder, self.generation_config)

    @cached_property
    def config_hash(self) -> str:
        """The hash K/V payloads carry: the config and the weight format (see kv_hash)."""
        return self.model.kv_hash()

    def generate_ar(self, requests: list[ARRequest], sampling: SamplingParams | None = None,
                    export_kv: bool = True, admission: Admission | None = None) -> list[AROutput]:
        """The requests through the AR scheduler (`ARGenerator.generate`), outputs in request order."""
        return self.ar.generate(requests, sampling, export_kv, admission)

    def generate_dit(self, requests: list[DiTRequest]) -> list[DiTOutput]:
        return [self.dit(r) for r in requests]


def build_model(config: HunyuanImage3Config, device: str | torch.device, parallel: Any = None,
                allocate: bool = True) -> HunyuanImage3ForCausalMM:
    """The network in its dtypes: built on the meta device (so the 80B model never exists in host
    memory), sliced for this rank when tensor parallel, then (allocate=True) given uninitialised
    storage on `device`. The router `wg` stays float32 and the VAE takes `vae_dtype` (official)."""
    with torch.device("meta"):
        net = HunyuanImage3ForCausalMM(config)
    net = net.to(DTYPES[config.torch_dtype])
    for module in net.modules():
        if isinstance(module, TopKGate):
            module.float()
    if hasattr(net, "vae"):
        net.vae.to(DTYPES[config.vae_dtype])
        net.vae.autocast_dtype = DTYPES.get(config.vae_autocast_dtype)
    if parallel is not None:
        from .parallel import parallelize

        parallelize(net, parallel)
    return net.to_empty(device=device) if allocate else net


@torch.no_grad()
def materialize(net: HunyuanImage3ForCausalMM, device: str | torch.device, weights_dir: Path | None, seed: int,
                quantize: bool = False) -> LoadStats:
    """Give a meta-device model its storage and values: the safetensors in `weights_dir`, or dummy
    weights when None. With `quantize`, decoder layers are allocated, filled and quantized to FP8
    one at a time, so the bf16 model never exists whole (the 80B model fits one H200 this way)."""
    def fill(prefix: str = "", skip: tuple[str, ...] = ()) -> LoadStats:
        if weights_dir is None:
            init_dummy_weights(net, seed, prefix=prefix, skip_prefixes=skip)
            return LoadStats()
        return load_pretrained(net, weights_dir, prefix=prefix, skip_prefixes=skip)

    if not quantize:
        net.to_empty(device=device)
        return fill()
    layers = net.model.layers
    net.model.layers = torch.nn.ModuleList()  # allocate everything but the decoder layers
    net.to_empty(device=device)
    net.model.layers = layers
    total = fill(skip=("model.layers.",))
    for i in net.stage_layers:  # this pipeline stage's layers (the others are placeholders)
        layer = layers[i]
        layer.to_empty(device=device)
        part = fill(prefix=f"model.layers.{i}.")
        quantize_model_fp8_(layer)
        total.tensors += part.tensors
        total.bytes_read += part.bytes_read
        total.seconds += part.seconds
    from .weights import peak_rss_gb

    total.peak_host_rss_gb = peak_rss_gb()
    return total


@torch.no_grad()
def build_model_fp8(config: HunyuanImage3Config, device: str | torch.device = "cpu", *,
                    weights: str | Path | None = None, seed: int = 0) -> HunyuanImage3ForCausalMM:
    """An FP8 model on `device` that never exists whole in full precision.

    weights=None: the engine's dummy weights, each decoder layer allocated, filled and quantized in
    turn (`materialize(quantize=True)`; peak = FP8 model + one bf16 layer). A checkpoint
    directory (FP8 or bf16/fp32): the FP8 structure is allocated once and `load_pretrained_fp8`
    fills it tensor by tensor (peak = FP8 model + one full-precision tensor)."""
    net = build_model(config, device, allocate=False)
    if weights is None:
        materialize(net, device, None, seed, quantize=True)
    else:
        quantize_model_fp8_(net)
        net.to_empty(device=device)
        load_pretrained_fp8(net, weights)
    return net.eval()


def describe(resolved: ResolvedModel) -> tuple[HunyuanImage3Config, Tokenizer, Any, dict[str, str] | None]:
    """config, tokenizer, generation config and system prompts of a preset or a checkpoint."""
    if resolved.kind == "preset":
        config = get_config(resolved.name)
        return config, load_tokenizer(None), _preset_generation_config(resolved.name), None
    directory = resolved.path
    config = HunyuanImage3Config.from_file(directory / "config.json")
    tokenizer = load_tokenizer(directory)
    return config, tokenizer, _checkpoint_generation_config(directory), _checkpoint_system_prompts(directory)


def _preset_generation_config(name: str) -> Any:
    try:
        from .generation_config import GenerationConfig, tiny_generation_config
    except ImportError:  # pragma: no cover - the module lands with the prompts work
        return None
    if name == "tiny":
        return tiny_generation_config()
    distil = name.endswith("distil")
    # the released Instruct / Instruct-Distil generation_config.json values
    return GenerationConfig.from_dict({
        "diff_infer_steps": 8 if distil else 50, "diff_guidance_scale": 2.5 if distil else 5.0,
        "flow_shift": 3.0, "bot_task": "think_recaption", "use_system_prompt": "en_unified",
        "sequence_template": "instruct", "max_new_tokens": 2048, "do_sample": True, "temperature": 0.6,
        "top_k": 1024, "top_p": 0.95, "drop_think": False, "max_length": 22800})


def _checkpoint_generation_config(directory: Path) -> Any:
    path = directory / "generation_config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint {directory} has no generation_config.json (steps, guidance and sampling "
                         "defaults come from it): the download is incomplete")
    try:
        from .generation_config import GenerationConfig
    except ImportError:  # pragma: no cover
        return None
    return GenerationConfig.from_file(path)


def _checkpoint_system_prompts(directory: Path) -> dict[str, str] | None:
    try:
        from .system_prompts import load_system_prompts
    except ImportError:  # pragma: no cover
        return None
    return load_system_prompts(directory)
