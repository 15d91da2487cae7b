"""config.json in the released schema, model resolution, and the official sigma schedule."""

from __future__ import annotations

import json

import pytest
import torch

from components.engine.config import HunyuanImage3Config, UnsupportedConfig, full_config, tiny_config
from components.engine.resolve import ModelNotFound, resolve_model
from components.engine.transformer import MLP, HunyuanImage3ForCausalMM, MoE

# The released Instruct config.json keys as third-party copies and the official
# HunyuanImage3Config document them (per-layer lists, nested vae/vit dicts, `dtype`, keys ardit
# does not use). Values at full size; the test shrinks nothing, it only parses.
RELEASED = {
    "architectures": ["HunyuanImage3ForCausalMM"], "auto_map": {"AutoConfig": "configuration_hunyuan_image_3.HunyuanImage3Config"},
    "model_type": "hunyuan_image_3_moe", "add_classification_head": False, "anyres_pooling_size": 2,
    "attention_bias": False, "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 127958,
    "capacity_factor": 1.0, "cfg_distilled": False, "cla_share_factor": 2, "class_num": 0,
    "cond_image_type": "vae_vit", "cond_token_attn_type": "joint_full", "dense_list": [4096, 0],
    "dtype": "bfloat16", "eod_token_id": 3, "eos_token_id": 127957, "group_limited_greedy": False,
    "hidden_act": "silu", "hidden_size": 4096, "im_end_id": 128001, "im_start_id": 128000,
    "image_token_id": 128006, "img_proj_type": "unet", "initializer_range": 0.02, "intermediate_size": 3072,
    "kv_lora_rank": None, "mask_init_id": 12, "max_position_embeddings": 22800, "mlp_bias": False,
    "model_version": "HunyuanImage-3.0-Instruct", "moe_drop_tokens": True, "moe_impl": "eager",
    "moe_intermediate_size": [3072] * 32, "moe_layer_num_skipped": 0, "moe_random_routing_dropped_token": False,
    "moe_topk": [8] * 32, "n_group": False, "norm_topk_prob": True, "norm_type": "rms",
    "num_attention_heads": 32, "num_experts": 64, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_media_embeds": 257, "num_shared_expert": [1] * 32, "pad_id": 128009, "pad_token_id": 128009,
    "pool_type": "last", "position_embedding_xdrope": False, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": None, "qk_rope_head_dim": None, "rms_norm_eps": 1e-05,
    "rope_scaling": {"alpha": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "type": "custom"},
    "rope_theta": 10000.0, "rope_type": "2d", "routed_scaling_factor": False, "skip_cls_token": False,
    "text_end_id": 7, "text_start_id": 6, "tie_word_embeddings": False, "topk_group": False,
    "transformers_version": "4.50.0", "use_cache": True, "use_cla": False, "use_meanflow": False,
    "use_mixed_mlp_moe": True, "use_mla": False, "use_qk_norm": True, "use_rotary_pos_emb": True,
    "v_head_dim": None, "vae_downsample_factor": [16, 16], "vae_type": "hunyuan-image-vae-v1",
    "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [128, 256, 512, 1024, 1024],
            "downsample_match_channel": True, "ffactor_spatial": 16, "ffactor_temporal": 4, "in_channels": 3,
            "latent_channels": 32, "layers_per_block": 2, "out_channels": 3, "sample_size": 384,
            "sample_tsize": 96, "scaling_factor": 0.562679178327931, "shift_factor": None,
            "upsample_match_channel": True},
    "vae_dtype": "float32", "vae_autocast_dtype": "float16",
    "vit": {"attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
            "intermediate_size": 4304, "layer_norm_eps": 1e-06, "num_attention_heads": 16, "num_channels": 3,
            "num_hidden_layers": 27, "num_patches": 256, "patch_size": 16},
    "vit_aligner": {"depth": 2, "input_dim": 1152, "n_embed": 4096, "projector_type": "mlp_gelu"},
    "vit_processor": {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "max_num_patches": 1024,
                      "patch_size": 16, "resample": 2, "rescale_factor": 0.00392156862745098},
    "vit_type": "siglip2-so400m-patch16-naflex", "vocab_size": 133120,
}


def test_released_schema_loads():
    cfg = HunyuanImage3Config.from_dict(RELEASED)
    assert cfg.layer("moe_topk", 31) == 8 and cfg.layer("moe_intermediate_size", 0) == 3072
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.vit.max_num_patches == 1024  # from vit_processor
    assert cfg.vae.ffactor_temporal == 4 and cfg.vae.latent_channels == 32 and cfg.vae_downsample_factor == 16
    assert cfg.moe_drop_tokens is True  # what the file says; the engine drops only when asked
    assert cfg.extra["anyres_pooling_size"] == 2  # unknown keys kept verbatim
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(cfg, with_conditioning=False)
    assert all(isinstance(layer.mlp, MoE) and layer.mlp.top_k == 8 for layer in model.model.layers)


def test_round_trip_keeps_the_schema():
    cfg = HunyuanImage3Config.from_dict(RELEASED)
    again = HunyuanImage3Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.to_dict()["vit_processor"]["max_num_patches"] == 1024
    assert again.to_dict()["moe_topk"] == [8] * 32


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value,expected", [("float32", "float32"), ("bfloat16", "bfloat16"), ("torch.float16", "float16")])
def test_dtype_is_read_from_either_key(key, value, expected):
    data = {k: v for k, v in RELEASED.items() if k != "dtype"}
    data[key] = value
    assert HunyuanImage3Config.from_dict(data).torch_dtype == expected


def test_per_layer_lists_build_per_layer_modules():
    cfg = tiny_config().replace(num_hidden_layers=3, moe_topk=[1, 2, 3], moe_intermediate_size=[32, 64, 96],
                                num_shared_expert=[1, 2, 1], moe_layer_num_skipped=1, intermediate_size=48)
    cfg.validate()
    with torch.device("meta"):
        layers = HunyuanImage3ForCausalMM(cfg, with_conditioning=False).model.layers
    assert isinstance(layers[0].mlp, MLP) and layers[0].mlp.down_proj.in_features == 48  # dense below the skip
    assert layers[1].mlp.top_k == 2 and layers[1].mlp.experts.down_proj.shape[-1] == 64
    assert layers[1].mlp.shared_mlp.down_proj.in_features == 128  # 64 x 2 shared experts
    assert layers[2].mlp.top_k == 3 and layers[2].mlp.experts.gate_and_up_proj.shape[1] == 192


@pytest.mark.parametrize("change,message", [
    ({"moe_topk": [8] * 31}, r"moe_topk has 31 entries, num_hidden_layers is 32"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"use_mla": True}, r"use_mla=True is not supported"),
    ({"rope_type": "default"}, r"rope_type='default' is not supported"),
    ({"norm_type": "torch_nn"}, r"norm_type='torch_nn' is not supported"),
    ({"moe_topk": "8"}, r"moe_topk='8': expected an integer or a per-layer list"),
    ({"cond_token_attn_type": "causal"}, r"cond_token_attn_type 'causal'"),
    ({"dtype": "int8"}, r"dtype 'int8'"),
    ({"num_key_value_heads": 7}, r"not a multiple of num_key_value_heads 7"),
])
def test_unsupported_shapes_are_one_line_errors(change, message):
    with pytest.raises(UnsupportedConfig, match=message) as e:
        HunyuanImage3Config.from_dict({**RELEASED, **change})
    assert "\n" not in str(e.value)


def test_tiny_preset_is_buildable_by_the_official_modules():
    """The official UNet ResBlocks and VAE use GroupNorm(32): every such width is a multiple of 32."""
    cfg = tiny_config()
    assert cfg.patch_embed_hidden_dim % 32 == 0 and cfg.hidden_size % 32 == 0
    assert all(c % 32 == 0 for c in cfg.vae.block_out_channels)
    assert cfg.vae.block_out_channels[-1] % (2 * cfg.vae.latent_channels) == 0  # official Encoder assert
    assert full_config().layer("moe_topk", 0) == 8


# ------------------------------------------------------------------------------ --model resolution
def test_resolve_presets_directories_and_errors(tmp_path):
    assert resolve_model("tiny").kind == "preset"
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt")).path == (tmp_path / "ckpt").resolve()
    with pytest.raises(ModelNotFound, match=r"checkpoint directory .*nope does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFound, match="unknown model 'hunyuan-image-9'"):
        resolve_model("hunyuan-image-9")


def test_resolve_repo_id_uses_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import importlib

    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)
    try:
        with pytest.raises(ModelNotFound, match=r"tencent/HunyuanImage-3.0-Instruct is not in the local Hugging Face "
                                                r"cache .*hf download tencent/HunyuanImage-3.0-Instruct") as e:
            resolve_model("tencent/HunyuanImage-3.0-Instruct")
        assert "\n" not in str(e.value)
        # a snapshot in the cache layout resolves to its directory
        snap = tmp_path / "hub" / "models--tencent--HunyuanImage-3.0-Instruct" / "snapshots" / "abc123"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        (tmp_path / "hub" / "models--tencent--HunyuanImage-3.0-Instruct" / "refs").mkdir()
        (tmp_path / "hub" / "models--tencent--HunyuanImage-3.0-Instruct" / "refs" / "main").write_text("abc123")
        resolved = resolve_model("tencent/HunyuanImage-3.0-Instruct")
        assert resolved.path == snap and resolved.name == "HunyuanImage-3.0-Instruct"
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)


# ------------------------------------------------------------------------------ sigma schedule
@pytest.mark.parametrize("steps", [1, 8, 20, 50])
def test_sigma_schedule_is_the_official_formula(steps):
    """Official FlowMatchDiscreteScheduler(shift=3, reverse=True): sigma = linspace(1, 0, N + 1), shifted
    s*sigma / (1 + (s - 1) * sigma), timesteps = sigma[:-1] * 1000; Euler x + v * (sigma' - sigma)."""
    from components.engine.dit import official_scheduler

    shift = 3.0
    sigmas = torch.linspace(1, 0, steps + 1)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    sched = official_scheduler(steps, shift)
    assert torch.equal(sched.sigmas.float(), sigmas)
    assert torch.equal(sched.timesteps.float(), sigmas[:-1] * 1000)
    x = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    out = sched.step(v, sched.timesteps[0], x).prev_sample
    assert torch.equal(out, x + v * (sigmas[1] - sigmas[0]))


def test_sigma_schedule_golden_values():
    # official values for 3 steps at shift 3 (reference brief): timesteps 1000, 857.1, 600.0
    from components.engine.dit import official_scheduler

    t = official_scheduler(3, 3.0).timesteps.tolist()
    assert t == pytest.approx([1000.0, 857.142857, 600.0], abs=1e-3)
    # diffusers' own default spacing differs (what ardit used before): the explicit sigmas matter
    from diffusers import FlowMatchEulerDiscreteScheduler

    default = FlowMatchEulerDiscreteScheduler(shift=3.0)
    default.set_timesteps(8)
    ours = official_scheduler(8, 3.0)
    assert (default.sigmas - ours.sigmas).abs().max().item() > 0.2
