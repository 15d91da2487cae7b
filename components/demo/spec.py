"""What the demo checkpoint is, besides its weights: config, tokenizer, system prompts, generation
settings. Shared by the training script (which writes them) and the tests.

Size: 128 x 128 images (`image_base_size` 128: an 8 x 8 latent grid through the 16x VAE), a
4-layer MoE transformer (4 experts, top-2, a shared expert, GQA 8/2 heads, QK-norm), a small VAE
and a 2-layer SigLIP2 tower: every feature of the released model, about 8M parameters.
"""

from __future__ import annotations

import random
from pathlib import Path

from components.engine.config import HunyuanImage3Config, VAEConfig, ViTConfig
from components.engine.generation_config import GenerationConfig

BASE_SIZE = 128
VOCAB_SIZE = 768  # the BPE target; the trained vocabulary is smaller
CONFIG_VOCAB = 576  # >= the trained tokenizers' tokens (557 in the shipped one; 571 built from today's corpus)
EXTRA_SPECIAL_TOKENS = [f"<img_size_{BASE_SIZE}>"]  # the tiny vocabulary has sizes 256 / 512 / 1024 only

DEMO_DIR = Path(__file__).resolve().parent.parent / "engine" / "assets" / "demo"

SYSTEM_PROMPTS = {
    "en_vanilla": "You draw and edit simple scenes.",
    "en_recaption": "You draw and edit simple scenes. Describe the picture in <recaption> tags.",
    "en_think_recaption": "You draw and edit simple scenes. Think in <think> tags, then describe the "
                          "picture in <recaption> tags.",
    "en_unified": "You draw and edit simple scenes. With <think>, say what to do; with <recaption>, "
                  "describe the picture.",
}


def demo_config() -> HunyuanImage3Config:
    layers = 4
    return HunyuanImage3Config(
        vocab_size=CONFIG_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        attention_head_dim=32,
        max_position_embeddings=4096,
        num_experts=4,
        moe_topk=[2] * layers,
        moe_intermediate_size=[384] * layers,
        num_shared_expert=[1] * layers,
        patch_embed_hidden_dim=128,
        image_base_size=BASE_SIZE,
        vae=VAEConfig(latent_channels=32, block_out_channels=(32, 32, 64, 64, 128), layers_per_block=1,
                      ffactor_temporal=1, sample_size=BASE_SIZE, sample_tsize=1, scaling_factor=1.0,
                      shift_factor=0.0),
        vit=ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_patches=64, max_num_patches=64),
        torch_dtype="float32",
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        model_version="ardit-demo",
        extra={"vit_processor": {"max_num_patches": 64}},
    )


def generation_config() -> GenerationConfig:
    """Instruct flow; greedy CoT (the demo's answers are deterministic), 10 steps at guidance 3."""
    return GenerationConfig(diff_infer_steps=10, diff_guidance_scale=3.0, flow_shift=3.0,
                            bot_task="think_recaption", use_system_prompt="en_unified",
                            sequence_template="instruct", max_new_tokens=72, do_sample=False, temperature=0.0,
                            top_k=0, top_p=1.0, drop_think=False, max_length=4096)


def tokenizer_corpus(n_scenes: int = 3000) -> list[str]:
    from components.data import sample

    rng = random.Random("demo-tokenizer")
    lines = list(SYSTEM_PROMPTS.values()) + ["User: ", "Assistant: "]
    for _ in range(n_scenes):
        scene = sample.random_caption_scene(rng)
        kind = rng.choice(list(sample.KIND_INSTRUCTIONS))
        think, recaption = sample.chain_of_thought(kind, scene)
        lines += [sample.caption(scene), sample.KIND_INSTRUCTIONS[kind], think, recaption,
                  *sample.chain_of_thought(None, scene)]
    return lines


def build_tokenizer():
    """A byte-level BPE for the scene vocabulary with every HunyuanImage-3 special token (deterministic)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from components.engine.tokenizer import SPECIAL_TOKENS

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS + EXTRA_SPECIAL_TOKENS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return tok
