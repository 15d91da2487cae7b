"""The instruct sequence layout of HunyuanImage-3, shared by the AR and the DiT.

Conditional row (IT2I; T2I is the same without conditioning images):

    <|startoftext|> SYSTEM "\\n\\n" "User: "
    [<boi><img_size_B><img_ratio_k><timestep> <img>*(h*w) <joint_img_sep> <img>*vit <eoi>]  per image
    USER_TEXT "\\n\\n" "Assistant: "
    <think> COT </think> <recaption> REWRITE </recaption>            (as the AR generated it)
    <answer><boi><img_size_B><img_ratio_k> <timestep> <img>*(h*w) <eoi></answer>

The unconditional row replaces USER_TEXT and the CoT inner text token-for-token by `<cfg>` and
keeps everything else, so both rows have the same length and layout.

Every text segment is encoded on its own, in the same order, by `SequenceBuilder`: the AR prompt
is exactly a prefix of the DiT sequence (no BPE merges across segment borders; vLLM-Omni #3499).
The AR's generated ids are carried as ids, never re-tokenised from text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tokenizer import Tokenizer

SYSTEM_PROMPTS = {
    "none": "",
    "en_vanilla": "You are an advanced AI text-to-image generation system. Given a detailed text prompt, "
                  "generate a high-quality image that matches it.",
    "en_recaption": "You are an image generation assistant. First rewrite the user's request as a detailed "
                    "image description, then generate the image.",
    "en_think_recaption": "You are an image generation assistant. Think about the user's request, rewrite it "
                          "as a detailed description, then generate the image.",
    "en_unified": "You are a helpful multimodal assistant that creates and edits images. Think about the "
                  "request, describe the target image in detail, then generate it.",
}

BOT_TASKS = ("image", "recaption", "think", "think_recaption")


# -- resolution buckets ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolution:
    width: int
    height: int

    @property
    def ratio(self) -> float:
        return self.height / self.width


class ResolutionGroup:
    """Aspect-ratio buckets around base_size x base_size (official `ResolutionGroup`, align 16).

    33 buckets from 1:2 to 2:1 stepping base/16 at a time, sorted by height/width, plus 4 extra
    resolutions (1024x768, 1280x720, 768x1024, 720x1280 scaled to base): `<img_ratio_0..36>`.
    """

    EXTRA_AT_1024 = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))

    def __init__(self, base_size: int = 1024, align: int = 16) -> None:
        self.base_size, self.align = base_size, align
        step = base_size // 16
        lo, hi = base_size // 2, base_size * 2
        sizes = [(base_size, base_size)]
        h = w = base_size
        while not (h >= hi and w <= lo):  # taller
            h, w = min(h + step, hi), max(w - step, lo)
            sizes.append((w, h))
        h = w = base_size
        while not (h <= lo and w >= hi):  # wider
            h, w = max(h - step, lo), min(w + step, hi)
            sizes.append((w, h))
        buckets = [Resolution(w // align * align, h // align * align) for w, h in sizes]
        self.buckets = sorted(buckets, key=lambda r: r.ratio)
        scale = base_size / 1024
        self.buckets += [Resolution(round(w * scale) // align * align, round(h * scale) // align * align)
                         for w, h in self.EXTRA_AT_1024]

    def __len__(self) -> int:
        return len(self.buckets)

    def size(self, ratio_index: int) -> tuple[int, int]:
        r = self.buckets[ratio_index]
        return r.width, r.height

    def nearest(self, width: int, height: int) -> int:
        """Index of the main bucket whose aspect ratio is closest to width x height."""
        target = height / width
        main = self.buckets[:33]
        return min(range(len(main)), key=lambda i: abs(main[i].ratio - target))

    def index_of(self, width: int, height: int) -> int | None:
        """Index of an exact bucket, or None when the size is not supported."""
        for i, r in enumerate(self.buckets):
            if (r.width, r.height) == (width, height):
                return i
        return None


# -- the sequence ---------------------------------------------------------------------------------
@dataclass
class ImageSlot:
    """Where one image sits in a sequence. Token grid h x w (patch size 1 on the VAE latent)."""

    timestep_index: int
    start: int  # first latent <img> token
    h: int
    w: int
    vit_start: int | None = None  # conditioning images only
    vit_len: int = 0
    vit_grid: tuple[int, int] | None = None  # valid ViT patches (rows, cols); the rest is padding

    @property
    def end(self) -> int:
        """One past the last token of the (joint) full-attention block."""
        return (self.vit_start + self.vit_len) if self.vit_start is not None else self.start + self.h * self.w


@dataclass
class Sequence:
    cond_ids: list[int]
    uncond_ids: list[int]
    cond_images: list[ImageSlot] = field(default_factory=list)
    gen_image: ImageSlot | None = None
    pos_reuse_len: int = 0  # AR K/V reusable for the cond row: index of </recaption>, </think> or <answer>
    neg_reuse_len: int = 0  # the uncond row shares the cond row's first neg_reuse_len tokens
    assistant_start: int = 0  # index of the first token after `Assistant: `

    def __len__(self) -> int:
        return len(self.cond_ids)

    @property
    def image_slots(self) -> list[ImageSlot]:
        return self.cond_images + ([self.gen_image] if self.gen_image else [])

    def full_blocks(self) -> list[tuple[int, int]]:
        """Bidirectional spans: each conditioning image's VAE+sep+ViT block, the generated image."""
        return [(s.start, s.end) for s in self.image_slots]

    def block_ids(self) -> torch.Tensor:
        """[L] long: index of the full-attention block a token belongs to, -1 for causal tokens."""
        ids = torch.full((len(self),), -1, dtype=torch.long)
        for b, (s, e) in enumerate(self.full_blocks()):
            ids[s:e] = b
        return ids

    def positions(self) -> torch.Tensor:
        """[L, 2] float (y, x) RoPE positions: text y = x = index; image blocks a centred 2-D grid."""
        pos = torch.arange(len(self), dtype=torch.float64).unsqueeze(1).repeat(1, 2)
        for s in self.image_slots:
            pos[s.start:s.start + s.h * s.w] = grid_positions(s.start, s.h, s.w)
            if s.vit_grid is not None:
                gh, gw = s.vit_grid
                pos[s.vit_start:s.vit_start + gh * gw] = grid_positions(s.vit_start, gh, gw)
        return pos


def grid_positions(start: int, h: int, w: int) -> torch.Tensor:
    """Centred 2-D grid for an h x w block at sequence index L (official build_2d_rope):
    y = L + (wh - h)/2 + row, x = L + (wh - w)/2 + col."""
    beta_y = start + (w * h - h) / 2
    beta_x = start + (w * h - w) / 2
    ys = torch.arange(h, dtype=torch.float64) + beta_y
    xs = torch.arange(w, dtype=torch.float64) + beta_x
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([gy.reshape(-1), gx.reshape(-1)], dim=1)


@dataclass
class CondImage:
    """A conditioning image's token footprint (the pixels are encoded elsewhere)."""

    latent_h: int
    latent_w: int
    ratio_index: int
    vit_grid: tuple[int, int]
    vit_len: int  # max_num_patches slots (valid + padding)


class SequenceBuilder:
    def __init__(self, tokenizer: Tokenizer, base_size: int) -> None:
        self.tok = tokenizer
        self.base_size = base_size
        self.resolutions = ResolutionGroup(base_size)

    # Segments are encoded one by one, always the same way.
    def _prefix(self, system_prompt: str, images: list[CondImage]) -> tuple[list[int], list[ImageSlot]]:
        tok = self.tok
        ids = [tok.bos]
        if system_prompt:
            ids += tok.encode(system_prompt) + tok.encode("\n\n")
        ids += tok.encode("User: ")
        slots = []
        for im in images:
            ids += [tok.boi, tok.size_id(self.base_size), tok.ratio_ids[im.ratio_index]]
            t_idx = len(ids)
            ids += [tok.timestep] + [tok.img] * (im.latent_h * im.latent_w) + [tok.joint_img_sep]
            vit_start = len(ids)
            ids += [tok.img] * im.vit_len + [tok.eoi]
            slots.append(ImageSlot(t_idx, t_idx + 1, im.latent_h, im.latent_w, vit_start, im.vit_len, im.vit_grid))
        return ids, slots

    def _through_assistant(self, system_prompt: str, images: list[CondImage], user_text: str):
        """Ids up to and including `Assistant: `, the image slots, and where the user text lies."""
        ids, slots = self._prefix(system_prompt, images)
        user_start = len(ids)
        user = self.tok.encode(user_text)
        ids += user + self.tok.encode("\n\n") + self.tok.encode("Assistant: ")
        return ids, slots, range(user_start, user_start + len(user))

    def ar_prompt(self, user_text: str, images: list[CondImage], bot_task: str, system_prompt: str) -> Sequence:
        """The AR prompt: everything up to `Assistant: ` plus the stage trigger."""
        if bot_task not in BOT_TASKS:
            raise ValueError(f"unknown bot_task {bot_task!r}; choose one of {BOT_TASKS}")
        tok = self.tok
        ids, slots, user_span = self._through_assistant(system_prompt, images, user_text)
        assistant_start = len(ids)
        if bot_task in ("think", "think_recaption"):
            ids += [tok.think]
        elif bot_task == "recaption":
            ids += [tok.recaption]
        else:
            ids += [tok.answer, tok.boi, tok.size_id(self.base_size)]
        uncond = [tok.cfg if i in user_span else t for i, t in enumerate(ids)]
        return Sequence(ids, uncond, slots, None, neg_reuse_len=first_difference(ids, uncond),
                        assistant_start=assistant_start)

    def dit_sequence(self, user_text: str, images: list[CondImage], assistant_ids: list[int],
                     system_prompt: str, ratio_index: int) -> Sequence:
        """The full DiT sequence. `assistant_ids` are the tokens after `Assistant: ` exactly as the
        AR fed them (trigger, CoT, end tags, `<answer><boi><img_size>`; the ratio token may be
        included or not: it is appended when absent)."""
        tok = self.tok
        ids, slots, user_span = self._through_assistant(system_prompt, images, user_text)
        assistant_start = len(ids)
        assistant = list(assistant_ids)
        answer_prefix = [tok.answer, tok.boi, tok.size_id(self.base_size)]
        ratio_id = tok.ratio_ids[ratio_index]
        if assistant and assistant[-1] in tok.ratio_ids:
            assistant = assistant[:-1]
        if assistant[-3:] != answer_prefix:
            raise ValueError("assistant ids must end with <answer><boi><img_size_B> (+ ratio token)")
        ids += assistant + [ratio_id]
        h, w = self.latent_grid(ratio_index)
        t_idx = len(ids)
        ids += [tok.timestep] + [tok.img] * (h * w) + [tok.eoi, tok.answer_end]
        gen = ImageSlot(t_idx, t_idx + 1, h, w)

        # Unconditional row: user text and CoT inner text -> <cfg>, token for token.
        keep = {tok.think, tok.think_end, tok.recaption, tok.recaption_end, *answer_prefix}
        uncond = list(ids)
        for i in user_span:
            uncond[i] = tok.cfg
        for i in range(assistant_start, assistant_start + len(assistant)):
            if uncond[i] not in keep:
                uncond[i] = tok.cfg
        seq = Sequence(ids, uncond, slots, gen, assistant_start=assistant_start)
        seq.pos_reuse_len = reuse_boundary(ids, tok, start=assistant_start)
        # Without any <cfg> (empty text) the rows agree up to the boundary: share all of it.
        seq.neg_reuse_len = min(first_difference(ids, uncond), seq.pos_reuse_len)
        return seq

    def latent_grid(self, ratio_index: int, downsample: int = 16) -> tuple[int, int]:
        w, h = self.resolutions.size(ratio_index)
        return h // downsample, w // downsample


def reuse_boundary(ids: list[int], tok: Tokenizer, start: int = 0) -> int:
    """Positive reuse length: index of `</recaption>`, else `</think>`, else `<answer>` (first one
    after `start`). The tag itself is not reused; everything before it was computed by the AR."""
    for tag in (tok.recaption_end, tok.think_end, tok.answer):
        for i in range(start, len(ids)):
            if ids[i] == tag:
                return i
    return 0


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where the rows differ (len when identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
