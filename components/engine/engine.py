"""Engine: the model, tokenizer and both stages, loaded once per step process."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .ar import ARGenerator, AROutput, ARRequest, SamplingParams
from .config import HunyuanImage3Config, get_config
from .dit import DiTGenerator, DiTOutput, DiTRequest
from .sequence import SequenceBuilder
from .tokenizer import Tokenizer, load_tokenizer
from .transformer import HunyuanImage3ForCausalMM
from .weights import init_dummy_weights, load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Engine:
    config: HunyuanImage3Config
    model: HunyuanImage3ForCausalMM
    tokenizer: Tokenizer
    builder: SequenceBuilder
    model_id: str

    @classmethod
    def load(cls, model: str = "tiny", weights: str | Path | None = None, device: str = "cpu",
             dtype: str | None = None, seed: int = 0) -> "Engine":
        """`model` is a preset name or a checkpoint directory (config.json, tokenizer, safetensors).

        weights=None -> the `dummy` load format: seeded random weights, no file.
        """
        if Path(model).is_dir():
            import json

            config = HunyuanImage3Config.from_dict(json.loads((Path(model) / "config.json").read_text()))
            tokenizer = load_tokenizer(model)
            weights = weights or model
            model_id = Path(model).name
        else:
            config = get_config(model)
            tokenizer = load_tokenizer(None) if model == "tiny" else None
            model_id = model
        if dtype:
            config = config.replace(torch_dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {model!r} needs a checkpoint directory for its tokenizer")
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, config vocab is {config.vocab_size}")

        if config.torch_dtype == "float32" and device != "cpu":
            # cuDNN convolutions default to TF32; its rounding is discontinuous, so tiny input
            # differences jump to ~1e-3 and grow through CFG. float32 must mean float32.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        torch.manual_seed(seed)
        net = HunyuanImage3ForCausalMM(config)
        if weights is None:
            init_dummy_weights(net, seed)
        else:
            load_pretrained(net, weights)
        net = net.to(device=device, dtype=DTYPES[config.torch_dtype]).eval()
        net.model.layers.apply(_keep_router_fp32)
        return cls(config, net, tokenizer, SequenceBuilder(tokenizer, config.image_base_size), model_id)

    @cached_property
    def ar(self) -> ARGenerator:
        return ARGenerator(self.model, self.tokenizer, self.builder, self.model_id)

    @cached_property
    def dit(self) -> DiTGenerator:
        return DiTGenerator(self.model, self.builder)

    @cached_property
    def config_hash(self) -> str:
        return self.config.config_hash()

    def generate_ar(self, requests: list[ARRequest], sampling: SamplingParams | None = None,
                    export_kv: bool = True) -> list[AROutput]:
        return self.ar(requests, sampling, export_kv)

    def generate_dit(self, requests: list[DiTRequest]) -> list[DiTOutput]:
        return [self.dit(r) for r in requests]


def _keep_router_fp32(module: torch.nn.Module) -> None:
    """The router `wg` stays fp32 whatever the model dtype (official checkpoint layout)."""
    from .transformer import TopKGate

    if isinstance(module, TopKGate):
        module.float()
