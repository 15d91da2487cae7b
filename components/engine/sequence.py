"""The HunyuanImage-3 sequence layout, shared by the AR and the DiT, token for token the official one.

The official chat template (`apply_chat_template` / `apply_general_template` in
tokenization_hunyuan_image_3.py) turns a request into a list of *segments*: text segments, each
encoded on its own with `tokenizer.encode(text, add_special_tokens=False)`, and image blocks.
`SequenceBuilder` builds the same segments and encodes them the same way. Conditional row of the
`instruct` template (IT2I; T2I is the same without conditioning images):

    <|startoftext|> SYSTEM "\\n\\n"
    "User: " [<boi><img_size_B><img_ratio_k><timestep> <img>*(h*w) <joint_img_sep> <img>*vit <eoi>]  per image
    USER_TEXT "\\n\\n"
    "Assistant: " <think> THINK </think> <recaption> RECAPTION </recaption>        (the CoT, re-encoded)
    <answer> <boi><img_size_B><img_ratio_k><timestep>[<guidance>][<timestep_r>] <img>*(h*w) <eoi> </answer> "\\n\\n"

The `pretrain` template (base checkpoint) has no role prefixes, separators or answer tags. The
unconditional (CFG) row replaces every uncond-enabled text segment (the user text and the CoT text,
not the system prompt, role prefixes or tags) token for token by `<cfg>`, so both rows have the
same length. The AR prompt is the same template up to the assistant turn, ending in the official
`bot_response_prefix` segment ("Assistant: <think>", "Assistant: <answer><boi><img_size_B>", ...).

The DiT sequence re-encodes the CoT *text* (as the official `generate_image` does), so it can differ
from the ids the AR generated; the AR's K/V is reused for the longest common prefix, up to the
reuse boundary (`</recaption>`, else `</think>`, else `<answer>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .tokenizer import Tokenizer

BOT_TASKS = ("image", "recaption", "think", "think_recaption", "auto")
SEQUENCE_TEMPLATES = ("instruct", "pretrain")

# Official chat template ("hunyuan-image-3" conversation): roles, separator.
USER_PREFIX, ASSISTANT_PREFIX, SEPARATOR = "User: ", "Assistant: ", "\n\n"


# -- resolution buckets ---------------------------------------------------------------------------
class Resolution:
    """An image size, parsed as the official `Resolution`: a "HxW" string is HEIGHT x WIDTH."""

    def __init__(self, size: str | int | tuple[int, int], *args: int) -> None:
        if isinstance(size, str):
            size = tuple(int(s) for s in size.split("x")) if "x" in size else int(size)
        if args:
            size = (size, args[0])
        if isinstance(size, int):
            size = (size, size)
        self.height, self.width = int(size[0]), int(size[1])

    @property
    def ratio(self) -> float:
        return self.height / self.width

    def __repr__(self) -> str:
        return f"Resolution(height={self.height}, width={self.width})"


# The official image processor's extra buckets (image_processor.py), parsed as HEIGHT x WIDTH and
# not rescaled with the base size.
EXTRA_RESOLUTIONS = ("1024x768", "1280x720", "768x1024", "720x1280")


class ResolutionGroup:
    """The official `ResolutionGroup(base_size, align=16, extra_resolutions=...)` of the image processor.

    Main buckets: from base x base, step base/16, one side growing to 2*base while the other
    shrinks to base/2 (aligned down to `align`), sorted by height/width: ratios 1:4 .. 4:1, index
    16 is square. Then each extra resolution whose ratio is not already present. Index i is the
    `<img_ratio_i>` token.
    """

    def __init__(self, base_size: int = 1024, align: int = 16,
                 extra_resolutions: tuple[str, ...] = EXTRA_RESOLUTIONS) -> None:
        if base_size % align:
            raise ValueError(f"base_size {base_size} is not divisible by align {align}")
        self.base_size, self.align = base_size, align
        step = base_size // 16
        lo, hi = base_size // 2, base_size * 2
        data = [Resolution(base_size, base_size)]
        for grow_height in (True, False):
            h = w = base_size
            while not ((h >= hi and w <= lo) if grow_height else (h <= lo and w >= hi)):
                if grow_height:
                    h, w = min(h + step, hi), max(w - step, lo)
                else:
                    h, w = max(h - step, lo), min(w + step, hi)
                data.append(Resolution(h // align * align, w // align * align))
        data.sort(key=lambda r: r.ratio)  # stable, as the official sorted()
        for text in extra_resolutions:
            extra = Resolution(text)
            if all(r.ratio != extra.ratio for r in data):
                data.append(extra)
        self.data = data
        self._ratios = np.array([r.ratio for r in data])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Resolution:
        return self.data[index]

    def size(self, ratio_index: int) -> tuple[int, int]:
        """(width, height) of bucket `ratio_index`."""
        r = self.data[ratio_index]
        return r.width, r.height

    def ratio_index(self, width: int, height: int) -> int:
        """The official `get_base_size_and_ratio_index`: the bucket (any of them, extras included)
        whose height/width is nearest to `height / width`; the first one on a tie."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size must be positive, got {width}x{height} (WxH)")
        return int(np.argmin(np.abs(self._ratios - height / width)))

    def get_target_size(self, width: int, height: int) -> tuple[int, int]:
        """The official `get_target_size`: (width, height) of the nearest-ratio bucket."""
        return self.size(self.ratio_index(width, height))

    def get_base_size_and_ratio_index(self, width: int, height: int) -> tuple[int, int]:
        return self.base_size, self.ratio_index(width, height)

    def index_of(self, width: int, height: int) -> int | None:
        """Index of the bucket of exactly width x height, or None."""
        for i, r in enumerate(self.data):
            if (r.width, r.height) == (width, height):
                return i
        return None


def parse_image_size(value: str | tuple[int, int] | list[int] | None) -> str | tuple[int, int]:
    """A request's target size: "auto", or (width, height).

    ardit's user-facing format is WIDTH x HEIGHT ("1280x720" is landscape); the official
    `image_size` string is HEIGHT x WIDTH. Also accepted: "W:H" (an aspect ratio, as the official
    "W:H" form) and "<img_ratio_k>" (returned as that bucket's ratio index, a string). Any ratio is
    accepted: it is mapped to the nearest bucket (official `get_target_size`)."""
    if value is None or value == "auto" or value == "":
        return "auto"
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
            raise ValueError(f"image size must be two positive integers (width, height), got {value!r}")
        return int(value[0]), int(value[1])
    text = str(value).strip()
    if text.startswith("<img_ratio_") and text.endswith(">"):
        return text
    for sep in ("x", "X", ":"):
        if sep in text:
            parts = text.split(sep)
            if len(parts) == 2 and all(p.strip().isdigit() and int(p) > 0 for p in parts):
                return int(parts[0]), int(parts[1])
    raise ValueError(f"image size {value!r} is not 'auto', 'WIDTHxHEIGHT' (e.g. 1280x720) or 'W:H' (e.g. 16:9)")


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
    guidance_index: int | None = None  # Instruct-Distil: the <guidance> token (embeds the guidance scale)
    timestep_r_index: int | None = None  # Instruct-Distil meanflow: the <timestep_r> token

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
    # Leading cond-row tokens whose K/V the AR computed and the DiT may reuse: the official boundary
    # (</recaption>, else </think>; ardit also <answer>), capped by the AR/DiT common prefix.
    pos_reuse_len: int = 0
    neg_reuse_len: int = 0  # the uncond row shares the cond row's first neg_reuse_len tokens
    assistant_start: int = 0  # index of the assistant turn's first token ("Assistant: " included)
    reuse_boundary: int = 0  # the official boundary alone (before capping by the AR ids)
    cfg_distilled: bool = False  # Instruct-Distil: no uncond row at all (official cfg_factor 1)
    infer_align_image_size: bool = False  # cond images were stretched to their bucket (official flag)

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
    orig_width: int = 0  # the image as given (for the official infer_align_image_size output resize)
    orig_height: int = 0


# -- segments -------------------------------------------------------------------------------------
@dataclass
class _Text:
    text: str
    uncond: bool = False  # replaced by <cfg> tokens in the unconditional row


@dataclass
class _CondBlock:
    image: CondImage


@dataclass
class _GenBlock:
    ratio_index: int


class UserTextError(ValueError):
    """The user's text would forge part of the image layout."""


class SequenceBuilder:
    """Builds AR prompts and DiT sequences from segments, as the official chat template.

    `guidance_token` / `timestep_r_token`: Instruct-Distil's `cfg_distilled` / `use_meanflow`
    (official `build_gen_image_info(add_guidance_token=..., add_timestep_r_token=...)`).
    `max_length`: the generation config's limit on a sequence (official apply_chat_template).
    """

    def __init__(self, tokenizer: Tokenizer, base_size: int, *, sequence_template: str = "instruct",
                 guidance_token: bool = False, timestep_r_token: bool = False,
                 max_length: int | None = None) -> None:
        if sequence_template not in SEQUENCE_TEMPLATES:
            raise ValueError(f"unknown sequence_template {sequence_template!r}; choose one of {SEQUENCE_TEMPLATES}")
        self.tok = tokenizer
        self.base_size = base_size
        self.resolutions = ResolutionGroup(base_size)
        self.sequence_template = sequence_template
        self.guidance_token, self.timestep_r_token = guidance_token, timestep_r_token
        self.max_length = max_length
        instruct = sequence_template == "instruct"
        self.user_prefix = USER_PREFIX if instruct else ""
        self.assistant_prefix = ASSISTANT_PREFIX if instruct else ""
        self.separator = SEPARATOR if instruct else ""
        self.answer_open = "<answer>" if instruct else ""
        self.answer_close = "</answer>" if instruct else ""

    @classmethod
    def from_config(cls, tokenizer: Tokenizer, config, generation_config=None) -> "SequenceBuilder":
        """From the model config (`image_base_size`, `cfg_distilled`, `use_meanflow`) and the
        generation config (`sequence_template`, `max_length`)."""
        gc = generation_config
        return cls(tokenizer, config.image_base_size,
                   sequence_template=getattr(gc, "sequence_template", None) or "instruct",
                   guidance_token=bool(getattr(config, "cfg_distilled", False)),
                   timestep_r_token=bool(getattr(config, "use_meanflow", False)),
                   max_length=getattr(gc, "max_length", None))

    # -- public -------------------------------------------------------------------------------
    def check_user_text(self, user_text: str) -> list[int]:
        """Encode the user's text; raise UserTextError if it holds an image-structure token."""
        ids = self.tok.encode(user_text)
        bad = self.tok.image_structure_token_in(ids)
        if bad is not None:
            raise UserTextError(f"prompt contains the image-structure token {bad!r}, which only the "
                                "sequence layout may place; remove it from the prompt")
        return ids

    def ar_prompt(self, user_text: str, images: list[CondImage], bot_task: str, system_prompt: str) -> Sequence:
        """The AR prompt: the template up to the assistant turn, then the official bot response
        prefix: `<think>` (think, think_recaption), `<recaption>`, `<answer><boi><img_size_B>`
        (image: the one-token ratio pass), nothing (auto: plain text answer)."""
        if bot_task not in BOT_TASKS:
            raise ValueError(f"unknown bot_task {bot_task!r}; choose one of {BOT_TASKS}")
        self.check_user_text(user_text)
        trigger = {"think": "<think>", "think_recaption": "<think>", "recaption": "<recaption>",
                   "image": f"{self.answer_open}<boi><img_size_{self.base_size}>", "auto": ""}[bot_task]
        segments = self._context(system_prompt, images, user_text)
        assistant_at = len(segments)
        segments.append(_Text(self.assistant_prefix + trigger))
        return self._encode(segments, assistant_at)

    def dit_sequence(self, user_text: str, images: list[CondImage], cot_text: str | None, system_prompt: str,
                     ratio_index: int, *, ar_ids: list[int] | None = None, drop_think: bool = False) -> Sequence:
        """The full DiT sequence (official `apply_chat_template(mode="gen_image", ...)`).

        `cot_text`: the official cot text (trigger tag + the decoded CoT through its end tag), or
        None/"" for no CoT. `ar_ids`: the ids the AR fed (its K/V exists for them); the reuse
        length is capped by their common prefix with this sequence. `drop_think`: leave out
        `<think>...</think>` sections (official `drop_think`)."""
        self.check_user_text(user_text)
        segments = self._context(system_prompt, images, user_text)
        assistant_at = len(segments)
        segments.append(_Text(self.assistant_prefix))
        segments += self._cot_segments(cot_text, drop_think) if cot_text else []
        segments += [_Text(self.answer_open), _GenBlock(ratio_index), _Text(self.answer_close),
                     _Text(self.separator)]
        seq = self._encode(segments, assistant_at)
        seq.reuse_boundary = reuse_boundary(seq.cond_ids, self.tok, start=seq.assistant_start)
        if seq.reuse_boundary == 0:  # pretrain template, no CoT: the image block's <boi>
            seq.reuse_boundary = seq.gen_image.timestep_index - 3
        pos = seq.reuse_boundary
        if ar_ids is not None:
            pos = min(pos, first_difference(ar_ids, seq.cond_ids))
        seq.pos_reuse_len = pos
        # Without any <cfg> (empty text) the rows agree up to the boundary: share all of it.
        seq.neg_reuse_len = min(first_difference(seq.cond_ids, seq.uncond_ids), pos)
        return seq

    def latent_grid(self, ratio_index: int, downsample: int = 16) -> tuple[int, int]:
        w, h = self.resolutions.size(ratio_index)
        return h // downsample, w // downsample

    # -- segments -----------------------------------------------------------------------------
    def _context(self, system_prompt: str, images: list[CondImage], user_text: str) -> list:
        """System and user turns (official `process_successive_message` for both roles)."""
        segments: list = []
        if system_prompt:
            segments += [_Text(""), _Text(system_prompt), _Text(self.separator)]
        segments.append(_Text(self.user_prefix))
        segments += [_CondBlock(im) for im in images]
        segments += [_Text(user_text, uncond=True), _Text(self.separator)]
        return segments

    def _cot_segments(self, cot_text: str, drop_think: bool) -> list:
        """The assistant's CoT text as the official `get_cot_sections`: `<think>`/`<recaption>`
        sections become tag + inner text + end tag; text outside them stays (uncond) text; a text
        with no complete tag pair is wrapped in `<answer>...</answer>` as one uncond segment."""
        tags = (("<think>", "</think>"), ("<recaption>", "</recaption>"))
        if not any(open_ in cot_text and close in cot_text for open_, close in tags):
            return [_Text(f"{self.answer_open}{cot_text}{self.answer_close}", uncond=True)]
        return self._cot_sections(cot_text, drop_think)

    def _cot_sections(self, text: str, drop_think: bool) -> list:
        if not text:
            return []
        for open_, close in (("<think>", "</think>"), ("<recaption>", "</recaption>")):
            if open_ in text and close in text:
                before = text.split(open_)[0]
                after = text.split(close)[1]
                inner = text.split(open_)[1].split(close)[0]
                section = [] if (drop_think and open_ == "<think>") else \
                    [_Text(open_), _Text(inner, uncond=True), _Text(close)]
                return self._cot_sections(before, drop_think) + section + self._cot_sections(after, drop_think)
        return [_Text(text, uncond=True)]

    def _encode(self, segments: list, assistant_at: int) -> Sequence:
        tok = self.tok
        cond, uncond = [tok.bos], [tok.bos]
        slots: list[ImageSlot] = []
        gen = None
        assistant_start = 0
        for i, seg in enumerate(segments):
            if i == assistant_at:
                assistant_start = len(cond)
            if isinstance(seg, _Text):
                ids = tok.encode(seg.text)
                cond += ids
                uncond += [tok.cfg] * len(ids) if seg.uncond else ids
                continue
            if isinstance(seg, _CondBlock):
                im = seg.image
                block = [tok.boi, tok.size_id(self.base_size), tok.ratio_ids[im.ratio_index]]
                t_idx = len(cond) + len(block)
                block += [tok.timestep] + [tok.img] * (im.latent_h * im.latent_w) + [tok.joint_img_sep]
                vit_start = len(cond) + len(block)
                block += [tok.img] * im.vit_len + [tok.eoi]
                slots.append(ImageSlot(t_idx, t_idx + 1, im.latent_h, im.latent_w, vit_start, im.vit_len,
                                       tuple(im.vit_grid)))
            else:  # _GenBlock
                h, w = self.latent_grid(seg.ratio_index)
                block = [tok.boi, tok.size_id(self.base_size), tok.ratio_ids[seg.ratio_index], tok.timestep]
                t_idx = len(cond) + 3
                guidance_index = timestep_r_index = None
                if self.guidance_token:
                    guidance_index = len(cond) + len(block)
                    block.append(tok.guidance)
                if self.timestep_r_token:
                    timestep_r_index = len(cond) + len(block)
                    block.append(tok.timestep_r)
                start = len(cond) + len(block)
                block += [tok.img] * (h * w) + [tok.eoi]
                gen = ImageSlot(t_idx, start, h, w, guidance_index=guidance_index,
                                timestep_r_index=timestep_r_index)
            cond += block
            uncond += block
        if self.max_length is not None and len(cond) > self.max_length:
            raise ValueError(f"sequence of {len(cond)} tokens exceeds max_length {self.max_length} "
                             "(generation config)")
        seq = Sequence(cond, uncond, slots, gen, assistant_start=assistant_start,
                       cfg_distilled=self.guidance_token)
        seq.neg_reuse_len = first_difference(cond, uncond)
        return seq


def reuse_boundary(ids: list[int], tok: Tokenizer, start: int = 0) -> int:
    """Official reuse boundary: index of the first `</recaption>` after `start`, else `</think>`;
    ardit falls back to `<answer>` (everything before the answer was computed by the AR). The tag
    itself is not reused. 0 when none is found."""
    for tag in (tok.recaption_end, tok.think_end, tok.answer):
        for i in range(start, len(ids)):
            if ids[i] == tag:
                return i
    return 0


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where the rows differ (the shorter length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
