"""Model configuration for the HunyuanImage-3 architecture.

Field names follow the official `configuration_hunyuan_image_3.py` keys so a checkpoint's
`config.json` can be read with `HunyuanImage3Config.from_dict`. Two presets:

- `tiny`: a few million parameters, runs in seconds on a CPU (tests, demos);
- `hunyuan-image-3`: the full 80B dimensions (dummy weights for performance work).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VAEConfig:
    """The image autoencoder: 16x spatial downsample, 32 latent channels."""

    in_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    downsample_factor: int = 16
    scaling_factor: float = 0.562679178327931
    shift_factor: float = 0.0
    norm_num_groups: int = 32


@dataclass
class ViTConfig:
    """The SigLIP2 (naflex) vision tower and its 2-layer aligner into the LLM width."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    max_num_patches: int = 729
    layer_norm_eps: float = 1e-6
    aligner_depth: int = 2


@dataclass
class HunyuanImage3Config:
    # text backbone
    vocab_size: int = 133120
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    attention_head_dim: int = 128
    max_position_embeddings: int = 22800
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_qk_norm: bool = True
    attention_bias: bool = False
    # MoE: softmax router, top-k renormalised, plus a shared expert; never drops tokens
    num_experts: int = 64
    moe_topk: int = 8
    moe_intermediate_size: int = 3072
    num_shared_expert: int = 1
    use_mixed_mlp_moe: bool = True
    # image generation heads
    patch_size: int = 1
    patch_embed_hidden_dim: int = 1024
    image_base_size: int = 1024
    cond_token_attn_type: str = "joint_full"
    vae: VAEConfig = field(default_factory=VAEConfig)
    vit: ViTConfig = field(default_factory=ViTConfig)
    # dtype the transformer runs in ("float32" | "bfloat16" | "float16")
    torch_dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def vae_downsample_factor(self) -> int:
        return self.vae.downsample_factor

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HunyuanImage3Config":
        """Build from a dict (e.g. a checkpoint config.json); unknown keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known and k not in ("vae", "vit")}
        vae = data.get("vae") or {}
        vit = data.get("vit") or {}
        vae_known = {f.name for f in dataclasses.fields(VAEConfig)}
        vit_known = {f.name for f in dataclasses.fields(ViTConfig)}
        if "block_out_channels" in vae:
            vae = {**vae, "block_out_channels": tuple(vae["block_out_channels"])}
        return cls(
            **kwargs,
            vae=VAEConfig(**{k: v for k, v in vae.items() if k in vae_known}),
            vit=ViTConfig(**{k: v for k, v in vit.items() if k in vit_known}),
        )

    def config_hash(self) -> str:
        """Stable short hash of everything that changes the K/V a prompt produces."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "HunyuanImage3Config":
        return dataclasses.replace(self, **changes)


def tiny_config() -> HunyuanImage3Config:
    """A few million parameters; every architectural feature kept (GQA, MoE + shared, QK-norm)."""
    return HunyuanImage3Config(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=16,
        max_position_embeddings=4096,
        num_experts=4,
        moe_topk=2,
        moe_intermediate_size=64,
        patch_embed_hidden_dim=32,
        image_base_size=256,
        vae=VAEConfig(block_out_channels=(8, 16, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                      scaling_factor=1.0),
        vit=ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      max_num_patches=64),
        torch_dtype="float32",
    )


def full_config() -> HunyuanImage3Config:
    """The released HunyuanImage-3.0 dimensions (80B total, 13B active)."""
    return HunyuanImage3Config()


PRESETS = {"tiny": tiny_config, "hunyuan-image-3": full_config}


def get_config(name: str, **overrides: Any) -> HunyuanImage3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
