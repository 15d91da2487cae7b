"""Model configuration for the HunyuanImage-3 architecture, in the schema of the released config.json.

`HunyuanImage3Config.from_dict` reads a checkpoint's `config.json` as published (the official
`HunyuanImage3Config` keys: per-layer lists for `moe_topk` / `moe_intermediate_size` /
`num_shared_expert`, nested `vae` / `vit` / `vit_processor` / `vit_aligner` dicts, `dtype` or
`torch_dtype`, and keys ardit has no use for, which are kept verbatim in `extra`). Shapes ardit
cannot run (another activation, norm, RoPE, MLA, a list of the wrong length, ...) are rejected with
a one-line `UnsupportedConfig`. `to_dict` writes the same schema back (test fixtures use it).

Presets: `tiny` (a few million parameters, every architectural feature kept, loadable by the
official code too: every GroupNorm width is a multiple of 32) and `hunyuan-image-3` /
`hunyuan-image-3-distil` (the released 80B dimensions, for performance work with dummy weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UnsupportedConfig(ValueError):
    """config.json describes a model ardit cannot run; the message names the key and the value."""


@dataclass
class VAEConfig:
    """The official `vae` dict (`AutoencoderKLConv3D` arguments)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    ffactor_spatial: int = 16
    ffactor_temporal: int = 4
    sample_size: int = 384
    sample_tsize: int = 96
    scaling_factor: float = 0.562679178327931
    shift_factor: float | None = None
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True

    @property
    def downsample_factor(self) -> int:
        return self.ffactor_spatial


@dataclass
class ViTConfig:
    """The SigLIP2 so400m-patch16-naflex tower (official `vit` dict) plus the two keys ardit reads
    from `vit_processor` (max_num_patches) and `vit_aligner` (depth)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    num_patches: int = 256  # learned position table (16 x 16), resized per image by naflex
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    max_num_patches: int = 1024  # vit_processor.max_num_patches: ViT tokens are padded to this
    aligner_depth: int = 2  # vit_aligner.depth


# Keys of the official config.json that ardit reads (besides the nested dicts), with their defaults
# where the released file may omit them (defaults of the official HunyuanImage3Config class).
_LIST_KEYS = ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert")


@dataclass
class HunyuanImage3Config:
    # text backbone
    vocab_size: int = 133120
    hidden_size: int = 4096
    intermediate_size: int = 3072  # dense MLP width (layers below moe_layer_num_skipped)
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    attention_head_dim: int = 128
    max_position_embeddings: int = 22800
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    use_qk_norm: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    # MoE: softmax router, top-k renormalised, plus a shared expert. Scalars or per-layer lists.
    num_experts: int | list[int] = 64
    moe_topk: int | list[int] = 8
    moe_intermediate_size: int | list[int] = 3072
    num_shared_expert: int | list[int] = 1
    use_mixed_mlp_moe: bool = True
    moe_layer_num_skipped: int = 0
    norm_topk_prob: bool = True
    capacity_factor: float = 1.0
    moe_drop_tokens: bool = False  # what config.json says; the engine drops only when asked to
    # image generation heads
    patch_size: int = 1
    patch_embed_hidden_dim: int = 1024
    image_base_size: int = 1024
    cond_token_attn_type: str = "joint_full"
    cond_image_type: str = "vae_vit"
    cfg_distilled: bool = False  # Instruct-Distil: <guidance> token, no unconditional row
    use_meanflow: bool = False  # Instruct-Distil: <timestep_r> token
    vae: VAEConfig = field(default_factory=VAEConfig)
    vit: ViTConfig = field(default_factory=ViTConfig)
    vae_dtype: str = "float32"
    vae_autocast_dtype: str = "float16"
    # token ids the config carries (the tokenizer is the authority; kept for the round trip)
    pad_token_id: int | None = 128009
    bos_token_id: int | None = 127958
    eos_token_id: int | None = 127957
    model_version: str = "HunyuanImage-3.0"
    # dtype the transformer runs in ("float32" | "bfloat16" | "float16")
    torch_dtype: str = "bfloat16"
    # everything else config.json held, verbatim (written back by to_dict)
    extra: dict[str, Any] = field(default_factory=dict)

    # -- derived -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def vae_downsample_factor(self) -> int:
        return self.vae.ffactor_spatial

    def layer(self, key: str, index: int) -> Any:
        """A per-layer value: `moe_topk` etc. may be a scalar or one entry per layer."""
        value = getattr(self, key)
        return value[index] if isinstance(value, (list, tuple)) else value

    def is_moe_layer(self, index: int) -> bool:
        return self.layer("num_experts", index) > 1 and index >= self.moe_layer_num_skipped

    # -- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HunyuanImage3Config":
        """Build from a checkpoint's config.json (the official schema) or from `to_dict` output."""
        data = dict(data)
        _reject_unsupported(data)
        known = {f.name for f in dataclasses.fields(cls)} - {"vae", "vit", "extra", "torch_dtype"}
        kwargs = {k: data.pop(k) for k in list(data) if k in known}
        dtype = data.pop("dtype", None) or data.pop("torch_dtype", None) or "bfloat16"
        data.pop("torch_dtype", None)
        kwargs["torch_dtype"] = _dtype_name(dtype)
        vae = data.pop("vae", None) or {}
        vit = data.pop("vit", None) or {}
        vit_processor = data.pop("vit_processor", None) or {}
        vit_aligner = data.pop("vit_aligner", None) or {}
        if isinstance(data.get("vae_downsample_factor"), (list, tuple)):
            factors = data.pop("vae_downsample_factor")
            if len(set(factors)) != 1:
                raise UnsupportedConfig(f"vae_downsample_factor {factors}: only square factors are supported")
        extra = data.pop("extra", None) or {}
        extra.update(data)  # unknown keys stay verbatim
        if vit_processor:
            extra["vit_processor"] = vit_processor
        config = cls(**kwargs, vae=_vae_from_dict(vae), extra=extra,
                     vit=_vit_from_dicts(vit, vit_processor, vit_aligner))
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "HunyuanImage3Config":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedConfig(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The official config.json schema (what a released checkpoint carries)."""
        out: dict[str, Any] = {"architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
                               "hidden_act": "silu", "norm_type": "hf_rms", "rope_type": "2d",
                               "rope_scaling": {"type": "custom", "factor": 1.0}, "use_rotary_pos_emb": True,
                               "img_proj_type": "unet", "vae_type": "hunyuan-image-vae-v1",
                               "vit_type": "siglip2-so400m-patch16-naflex"}
        out.update(self.extra)  # what the checkpoint said wins over the defaults above
        for f in dataclasses.fields(self):
            if f.name in ("vae", "vit", "extra", "torch_dtype"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["dtype"] = self.torch_dtype
        vae = dataclasses.asdict(self.vae)
        vae["block_out_channels"] = list(vae["block_out_channels"])
        out["vae"] = vae
        out["vae_downsample_factor"] = [self.vae.ffactor_spatial, self.vae.ffactor_spatial]
        vit = dataclasses.asdict(self.vit)
        max_num_patches, depth = vit.pop("max_num_patches"), vit.pop("aligner_depth")
        out["vit"] = vit
        out["vit_processor"] = {"patch_size": self.vit.patch_size, "max_num_patches": max_num_patches,
                                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                                "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
        out["vit_processor"] = {**out["vit_processor"], **self.extra.get("vit_processor", {}),
                                "max_num_patches": max_num_patches}
        out["vit_aligner"] = {"projector_type": "mlp_gelu", "input_dim": self.vit.hidden_size,
                              "n_embed": self.hidden_size, "depth": depth}
        return out

    def validate(self) -> None:
        """Raise UnsupportedConfig for shapes the engine cannot build."""
        n = self.num_hidden_layers
        for key in _LIST_KEYS:
            value = getattr(self, key)
            if isinstance(value, (list, tuple)) and len(value) != n:
                raise UnsupportedConfig(f"{key} has {len(value)} entries, num_hidden_layers is {n}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedConfig(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                    f"num_key_value_heads {self.num_key_value_heads}")
        if self.attention_head_dim % 4:
            raise UnsupportedConfig(f"attention_head_dim {self.attention_head_dim} must be divisible by 4 (2-D RoPE)")
        for i in range(n):
            if self.is_moe_layer(i) and self.layer("moe_topk", i) > self.layer("num_experts", i):
                raise UnsupportedConfig(f"layer {i}: moe_topk {self.layer('moe_topk', i)} > num_experts "
                                        f"{self.layer('num_experts', i)}")
        if self.patch_size != 1:
            raise UnsupportedConfig(f"patch_size {self.patch_size}: ardit supports the released patch_size 1")
        if self.cond_token_attn_type not in ("joint_full", "full"):
            raise UnsupportedConfig(f"cond_token_attn_type {self.cond_token_attn_type!r}: supported are joint_full, full")
        if self.cond_image_type != "vae_vit":
            raise UnsupportedConfig(f"cond_image_type {self.cond_image_type!r}: supported is vae_vit")
        if self.torch_dtype not in DTYPE_NAMES:
            raise UnsupportedConfig(f"dtype {self.torch_dtype!r}: supported are {', '.join(DTYPE_NAMES)}")

    def config_hash(self) -> str:
        """Stable short hash of everything that changes the K/V a prompt produces."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "HunyuanImage3Config":
        return dataclasses.replace(self, **changes)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype_name(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    return aliases.get(name, name)


# (key, allowed values): what the engine implements. The official class accepts more.
_SUPPORTED = {
    "hidden_act": ("silu",),
    "norm_type": ("hf_rms", "rms"),
    "rope_type": ("2d",),
    "img_proj_type": ("unet",),
    "use_rotary_pos_emb": (True,),
    "use_mla": (False,),
    "use_cla": (False,),
    "group_limited_greedy": (False,),
    "add_classification_head": (False,),
}


def _reject_unsupported(data: dict[str, Any]) -> None:
    for key, allowed in _SUPPORTED.items():
        if key in data and data[key] not in allowed:
            raise UnsupportedConfig(f"config.json {key}={data[key]!r} is not supported (ardit runs {allowed[0]!r})")
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("type", "custom") != "custom":
        raise UnsupportedConfig(f"config.json rope_scaling {scaling} is not supported (ardit runs type 'custom')")
    for key in _LIST_KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, (int, list)):
            raise UnsupportedConfig(f"config.json {key}={value!r}: expected an integer or a per-layer list")
        if isinstance(value, list) and not all(isinstance(v, int) for v in value):
            raise UnsupportedConfig(f"config.json {key}: per-layer list must hold integers")
    if data.get("routed_scaling_factor", 1.0) != 1.0 and not data.get("norm_topk_prob", True):
        raise UnsupportedConfig("config.json routed_scaling_factor without norm_topk_prob is not supported")


def _vae_from_dict(vae: dict[str, Any]) -> VAEConfig:
    known = {f.name for f in dataclasses.fields(VAEConfig)}
    kwargs = {k: v for k, v in vae.items() if k in known}
    if "downsample_factor" in vae and "ffactor_spatial" not in vae:  # older ardit files
        kwargs["ffactor_spatial"] = vae["downsample_factor"]
    if "block_out_channels" in kwargs:
        kwargs["block_out_channels"] = tuple(kwargs["block_out_channels"])
    return VAEConfig(**kwargs)


def _vit_from_dicts(vit: dict, processor: dict, aligner: dict) -> ViTConfig:
    known = {f.name for f in dataclasses.fields(ViTConfig)}
    kwargs = {k: v for k, v in vit.items() if k in known}
    if "max_num_patches" in processor:
        kwargs["max_num_patches"] = processor["max_num_patches"]
    if "depth" in aligner:
        kwargs["aligner_depth"] = aligner["depth"]
    return ViTConfig(**kwargs)


def tiny_config() -> HunyuanImage3Config:
    """A few million parameters; every architectural feature kept (GQA, MoE + shared expert, QK-norm,
    per-layer MoE lists). Every GroupNorm width is a multiple of 32, as the official modules need."""
    return HunyuanImage3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_head_dim=16,
        max_position_embeddings=4096,
        num_experts=4,
        moe_topk=[2, 2],
        moe_intermediate_size=[64, 64],
        num_shared_expert=[1, 1],
        patch_embed_hidden_dim=32,
        image_base_size=256,
        # ffactor_temporal 1: an image is one frame, so the VAE does not run four copies of it
        vae=VAEConfig(latent_channels=32, block_out_channels=(32, 32, 32, 32, 64), layers_per_block=1,
                      ffactor_temporal=1, sample_size=256, sample_tsize=1, scaling_factor=1.0),
        vit=ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      max_num_patches=64),
        torch_dtype="float32",
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        model_version="ardit-tiny",
    )


def full_config() -> HunyuanImage3Config:
    """The released HunyuanImage-3.0-Instruct dimensions (80B total, 13B active)."""
    n = 32
    return HunyuanImage3Config(moe_topk=[8] * n, moe_intermediate_size=[3072] * n, num_shared_expert=[1] * n)


def full_distil_config() -> HunyuanImage3Config:
    """Instruct-Distil: the same network plus the `<guidance>` and `<timestep_r>` embedders."""
    return full_config().replace(cfg_distilled=True, use_meanflow=True)


PRESETS = {"tiny": tiny_config, "hunyuan-image-3": full_config, "hunyuan-image-3-distil": full_distil_config}


def get_config(name: str, **overrides: Any) -> HunyuanImage3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
