"""AR stage: batched prefill + chain-of-thought decode + ratio token, with prompt-KV export.

The decode follows the official `generate_image` (modeling_hunyuan_image_3.py) and its logits
processors, row by row:

    prompt ends with the bot response prefix: "Assistant: <think>" (think, think_recaption),
    "Assistant: <recaption>", "Assistant: <answer><boi><img_size_B>" (image), "Assistant: " (auto)
    stage transitions:  </think> -> forced <recaption>                         (think_recaption)
                        last end tag -> forced <answer><boi><img_size_B>       (when the size is "auto")
    after <img_size_B>: greedy choice among the ratio tokens (official id slices), which stops the row
    stop tokens:        a ratio token (size "auto"); else the end tag(s); auto: <|endoftext|>

Nothing else is constrained: the model may write any token in its CoT, as in the official code.
`max_new_tokens` bounds all generated tokens of a row, as HF `generate` does. Unlike the official
code (which fails when the budget runs out before a ratio token), ardit then closes the CoT: when
the remaining budget only just fits the closing tokens (end tags, forced transitions, ratio), they
are forced.

The kept CoT is the official `cot_text`: the trigger tag + the generated tokens through the first
end token, decoded to text; the DiT re-encodes it through the template.

There is one AR loop: ar_scheduler.py's continuous batching (rows join and leave the decode batch,
each prefilled alone in chunks, K/V in per-row slots). `ARGenerator.stream` runs it for the AR step;
`ARGenerator.generate` (`Engine.generate_ar`) runs it over a list and returns the outputs in order.
This module holds a row's logic, which the scheduler drives: `prepare_row`, then per token `choice`
(how the next token is chosen) and `advance` (take it), and `finish_row` (the AROutput, the K/V).

A row's tokens do not depend on the other rows in flight except through rounding: the GEMMs and
attention run over other shapes (more rows, other per-expert token counts), so K/V and logits differ
in the last bits and a CoT can drift. With the kernel setting `batch_invariant=on`
(`--batch-invariant`) every row decodes as its own batch of one, so its tokens and K/V are bitwise
independent of its batch and shard (cost: decode steps are no longer shared; see
benchmarks/moe_kernels.py).

The decode runs the static-shape step of kernels/decode.py (replayed as CUDA graphs where
`decode_graphs` selects it) and picks every row's token on the device (DeviceSampler, HF
`generate`'s temperature -> top-k -> top-p semantics). On the CPU a row samples from its own CPU
generator, seeded with the row's seed; on a GPU from a CUDA generator of that seed: the same seed
gives the same tokens, but not the tokens of the CPU.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import asdict, dataclass, field, fields

import torch
from PIL import Image

from .ar_scheduler import Admission, ARScheduler
from .generation_config import GenerationConfig, tiny_generation_config
from .inputs import EncodedImage, encode_cond_images, request_generator
from .kvcache import PromptKV
from .sequence import CondImage, Sequence, SequenceBuilder, first_difference, parse_image_size
from .system_prompts import TINY_SYSTEM_PROMPTS, resolve_system_prompt
from .tokenizer import Tokenizer
from .transformer import HunyuanImage3ForCausalMM

# Before a row's K/V is exported, write its decoded tokens' K/V again with one prefill chunk, so they
# come from the same kernels as the DiT's recompute (ARScheduler._write_decoded).
PREFILL_DECODED_KV = True

IMAGE_TASKS = ("image", "recaption", "think", "think_recaption")


@dataclass
class SamplingParams:
    """AR sampling; a field left None comes from the generation config."""

    temperature: float | None = None  # 0: greedy
    top_k: int | None = None  # 0: off
    top_p: float | None = None
    max_new_tokens: int | None = None  # all generated tokens of a row (forced ones included)
    do_sample: bool | None = None  # False: greedy

    def resolved(self, gc: GenerationConfig) -> "SamplingParams":
        pick = lambda mine, theirs: theirs if mine is None else mine  # noqa: E731
        out = SamplingParams(pick(self.temperature, gc.temperature), pick(self.top_k, gc.top_k),
                             pick(self.top_p, gc.top_p), pick(self.max_new_tokens, gc.max_new_tokens),
                             pick(self.do_sample, gc.do_sample))
        if not out.do_sample:
            out.temperature = 0.0
        return out

    @property
    def greedy(self) -> bool:
        return not self.temperature or self.do_sample is False


@dataclass
class ARRequest:
    id: str
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    image_size: str | tuple[int, int] = "auto"  # "auto" (the model picks the ratio), (width, height), "WxH", "W:H"
    bot_task: str | None = None  # None: the generation config's
    system_prompt: str | None = None  # a name (en_unified, dynamic, none, ...) or the text; None: generation config
    seed: int | None = None
    infer_align_image_size: bool = False  # official --infer-align-image-size: cond images stretched to their bucket


@dataclass
class AROutput:
    id: str
    user_text: str
    system_prompt: str  # the resolved text the DiT sequence uses (en_recaption after a drop_think switch)
    bot_task: str
    cond_images: list[CondImage]
    prompt_ids: list[int]
    generated_ids: list[int]  # as generated: forced tokens included, the stop token (ratio / end tag) last
    cot_text: str  # official cot_text: trigger tag + decoded CoT through its end tag; "" for none
    ratio_index: int  # -1 for a text-only answer
    image_size: tuple[int, int]  # (width, height); (0, 0) for a text-only answer
    drop_think: bool = False
    infer_align_image_size: bool = False
    answer_text: str = ""  # bot_task auto: the generated text answer (stop token not included)
    reencode_diff_at: int | None = None  # where the DiT sequence leaves the AR's tokens before the reuse boundary
    seed: int | None = None  # the row's seed: its stream drew the conditioning latents the K/V holds
    prompt_kv: PromptKV | None = None
    timings: dict = field(default_factory=dict)

    @property
    def is_text_only(self) -> bool:
        """bot_task auto: a text answer (I2T/T2T), no image to generate."""
        return self.bot_task == "auto"

    @property
    def fed_ids(self) -> list[int]:
        """The ids the AR ran through the model (its K/V exists for them): the prompt and every
        generated token but the last, which ended the row."""
        return self.prompt_ids + self.generated_ids[:-1]

    def dit_sequence(self, builder: SequenceBuilder) -> Sequence:
        """The DiT sequence of this request (the official re-encoding of the CoT text)."""
        if self.is_text_only:
            raise ValueError(f"request {self.id}: bot_task auto gave a text answer; there is no image to generate")
        seq = builder.dit_sequence(self.user_text, self.cond_images, self.cot_text or None, self.system_prompt,
                                   self.ratio_index, ar_ids=self.fed_ids, drop_think=self.drop_think)
        seq.infer_align_image_size = self.infer_align_image_size
        return seq

    def to_record(self) -> dict:
        """JSON-able dict (no tensors) for ar.parquet; the KV travels through the KV store."""
        # not asdict(self): it would deep-copy every K/V tensor only to drop them
        rec = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
               if f.name not in ("prompt_kv", "cond_images")}
        rec["cond_images"] = [asdict(c) for c in self.cond_images]
        rec["image_size"] = list(self.image_size)
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> "AROutput":
        rec = dict(rec)
        rec["cond_images"] = [CondImage(c["latent_h"], c["latent_w"], c["ratio_index"], tuple(c["vit_grid"]),
                                        c["vit_len"], c.get("orig_width", 0), c.get("orig_height", 0))
                              for c in rec.get("cond_images") or []]
        rec["image_size"] = tuple(rec["image_size"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in rec.items() if k in known})


def request_seed(seed: int | None, request_id: str) -> int:
    """The request's seed, or a stable one derived from its id."""
    return seed if seed is not None else zlib.crc32(request_id.encode())


@dataclass
class ARRow:
    request: ARRequest
    bot_task: str
    system_prompt: str
    seq: Sequence
    cond: list[EncodedImage]
    generator: torch.Generator
    transitions: dict[int, list[int]]  # official stage_transitions: tag -> forced tokens
    stop_ids: set[int]
    closing_tags: list[int]  # end tags, in order, forced when the budget runs out
    ratio_trigger: int | None  # <img_size_B>: the next token is the greedy ratio choice
    fixed_ratio: int | None  # ratio index from the request's image size
    last: int = 0  # the last token fed
    pending: list[int] = field(default_factory=list)
    completed: set[int] = field(default_factory=set)
    offset: int = 0  # left padding
    generated: list[int] = field(default_factory=list)
    done: bool = False
    forced_length: int | None = None  # ARDIT_BENCH_COT_TOKENS: the generated tokens this row gets


class ForcedCot:
    """ARDIT_BENCH_COT_TOKENS (benchmarks on dummy weights): every row's CoT runs to a set length.

    `N`: every row generates N tokens; `lognormal:MEDIAN:LO:HI`: a length per row from a lognormal
    of that median (sigma ln(HI/LO) / 4, clamped to [LO, HI]), drawn from a hash of the row id, so a
    row gets the same length in every run and arm. Random weights would end a CoT at an arbitrary
    token: until the length, the special tokens (end tags, ratio tokens, ...) are never sampled;
    at it, the row closes its stages as when its budget runs out (`ARGenerator.choice`); a length
    shorter than that closing path (end tags, forced transitions, ratio token) gets the path."""

    ENV = "ARDIT_BENCH_COT_TOKENS"

    def __init__(self, spec: str) -> None:
        self.spec = spec
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                self.median = self.lo = self.hi = int(parts[0])
            elif len(parts) == 4 and parts[0] == "lognormal":
                self.median, self.lo, self.hi = (int(p) for p in parts[1:])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{self.ENV}={spec!r}: expected N or lognormal:MEDIAN:LO:HI (whole numbers)") from None
        if not 1 <= self.lo <= self.median <= self.hi:
            raise ValueError(f"{self.ENV}={spec!r}: needs 1 <= LO <= MEDIAN <= HI")

    @classmethod
    def from_env(cls) -> "ForcedCot | None":
        import os

        spec = os.environ.get(cls.ENV)
        return cls(spec) if spec else None

    def length(self, row_id: str) -> int:
        import math
        from statistics import NormalDist

        if self.lo == self.hi:
            return self.lo
        u = (zlib.crc32(f"cot:{row_id}".encode()) + 0.5) / 2**32
        sigma = math.log(self.hi / self.lo) / 4
        return max(self.lo, min(self.hi, round(self.median * math.exp(sigma * NormalDist().inv_cdf(u)))))


class ARGenerator:
    """`generation_config` / `system_prompts`: the checkpoint's (Engine passes them); the tiny
    preset's when not given."""

    def __init__(self, model: HunyuanImage3ForCausalMM, tokenizer: Tokenizer, builder: SequenceBuilder,
                 model_id: str = "", generation_config: GenerationConfig | None = None,
                 system_prompts: dict[str, str] | None = None) -> None:
        self.model, self.tok, self.builder = model, tokenizer, builder
        self.model_id = model_id
        self.config_hash = model.kv_hash()
        self.generation_config = generation_config or tiny_generation_config()
        self.system_prompts = system_prompts or TINY_SYSTEM_PROMPTS
        self.forced_cot: ForcedCot | None = None  # benchmarks: ARDIT_BENCH_COT_TOKENS (the AR step sets it)
        self._banned: list[int] | None = None

    @property
    def prefill_decoded_kv(self) -> bool:
        """Whether decoded tokens' K/V are written again by a prefill chunk before export (the
        module's PREFILL_DECODED_KV, read at use: tests and benchmarks switch it)."""
        return PREFILL_DECODED_KV

    def banned_ids(self) -> list[int]:
        """Ids never sampled: the special tokens while a forced CoT length runs (ForcedCot)."""
        if self.forced_cot is None:
            return []
        if self._banned is None:
            from .tokenizer import SPECIAL_TOKENS

            self._banned = [i for i in (self.tok.token_id(t, required=False) for t in SPECIAL_TOKENS) if i is not None]
        return self._banned

    @torch.no_grad()
    def stream(self, requests: list[ARRequest], on_result, sampling: SamplingParams | None = None,
               export_kv: bool = True, admission=None) -> dict:
        """Continuous batching (engine/ar_scheduler.py): each request's AROutput, or the exception
        that failed it, goes to `on_result(request, result)` as soon as the row finishes, while the
        other rows decode on. `admission`: an ar_scheduler.Admission (default: this device's). The
        scheduler's statistics."""
        sampling = (sampling or SamplingParams()).resolved(self.generation_config)
        scheduler = ARScheduler(self, sampling, admission or Admission.for_model(self.model), export_kv)
        with self.model.autocast():
            return scheduler.run(requests, on_result)

    def generate(self, requests: list[ARRequest], sampling: SamplingParams | None = None,
                 export_kv: bool = True, admission=None) -> list[AROutput]:
        """Every request's AROutput, in request order, through the scheduler (`stream`); the
        failure of the first row that failed is raised once every row has run. `admission`:
        default, the whole list in flight at once (this device's K/V budget permitting)."""
        if admission is None:
            admission = Admission.for_model(self.model, batch_size=max(1, len(requests)))
        index = {id(r): i for i, r in enumerate(requests)}
        if len(index) != len(requests):
            raise ValueError("generate: the same ARRequest object is listed twice")
        results: list = [None] * len(requests)
        self.stream(requests, lambda req, out: results.__setitem__(index[id(req)], out), sampling, export_kv,
                    admission)
        for out in results:
            if isinstance(out, BaseException):
                raise out
        return results

    # -- a row's life, driven by the scheduler: prepare_row, then choice / advance per token, finish_row
    def prepare_row(self, req: ARRequest, cond: list[EncodedImage] | None = None) -> ARRow:
        """The request's row: its prompt, stage transitions and stop tokens (a bad request raises
        ValueError); `cond`: its conditioning images already encoded (else encoded here)."""
        tok, gc = self.tok, self.generation_config
        bot_task = req.bot_task or gc.bot_task
        if bot_task not in (*IMAGE_TASKS, "auto"):
            raise ValueError(f"request {req.id}: unknown bot_task {bot_task!r}; choose one of "
                             f"{(*IMAGE_TASKS, 'auto')}")
        choice = req.system_prompt if req.system_prompt is not None else gc.use_system_prompt
        system_prompt = resolve_system_prompt(choice, bot_task, self.system_prompts)
        size = parse_image_size(req.image_size)
        fixed_ratio = None
        if isinstance(size, str) and size.startswith("<img_ratio_"):
            fixed_ratio = int(size[len("<img_ratio_"):-1])
            if not 0 <= fixed_ratio < len(self.builder.resolutions):
                raise ValueError(f"request {req.id}: image size {size}: no such ratio bucket")
        elif size != "auto":
            fixed_ratio = self.builder.resolutions.ratio_index(*size)
        try:
            self.builder.check_user_text(req.prompt)
        except ValueError as e:
            raise ValueError(f"request {req.id}: {e}") from None
        # conditioning latents are posterior draws from the row's seeded stream, as in the DiT pass
        # (official CoT passes draw from an unseeded one), so AR and DiT see the same latents
        if cond is None:
            cond = encode_cond_images(self.model, self.builder, req.images, req.infer_align_image_size,
                                      self.cond_generator(req)) if req.images else []
        seq = self.builder.ar_prompt(req.prompt, [c.footprint for c in cond], bot_task, system_prompt)

        need_ratio = fixed_ratio is None
        size_id = tok.size_id(self.builder.base_size)
        answer_prefix = [tok.answer] if self.builder.sequence_template == "instruct" else []
        transitions: dict[int, list[int]] = {}
        if bot_task == "think_recaption":
            transitions[tok.think_end] = [tok.recaption]
        if bot_task in ("think", "recaption", "think_recaption") and need_ratio:
            last_tag = tok.recaption_end if "recaption" in bot_task else tok.think_end
            transitions[last_tag] = answer_prefix + [tok.boi, size_id]
        closing = {"think_recaption": [tok.think_end, tok.recaption_end], "think": [tok.think_end],
                   "recaption": [tok.recaption_end], "image": [], "auto": []}[bot_task]
        if bot_task == "auto":
            stop = {tok.eos}  # the conversation's stop token (official stop_token_ids: <|endoftext|>)
        elif need_ratio:
            stop = set(tok.ratio_choice_ids)
        else:
            stop = {"think_recaption": {tok.recaption_end}, "recaption": {tok.recaption_end},
                    "think": {tok.think_end, tok.recaption_end}, "image": set()}[bot_task]
        gen = torch.Generator().manual_seed(request_seed(req.seed, req.id))
        row = ARRow(req, bot_task, system_prompt, seq, cond, gen, transitions, stop, closing,
                   size_id if need_ratio and bot_task != "auto" else None, fixed_ratio, last=seq.cond_ids[-1])
        row.done = bot_task == "image" and not need_ratio  # a fixed size needs no AR token (official)
        if self.forced_cot is not None:
            row.forced_length = self.forced_cot.length(req.id)
        return row

    def cond_generator(self, req: ARRequest) -> torch.Generator:
        """The stream the request's conditioning latents are drawn from."""
        return request_generator(self.model, request_seed(req.seed, req.id))

    def sampling_generator(self, row: ARRow) -> torch.Generator:
        """The row's sampling stream for `DeviceSampler`: its own generator on the CPU, on a GPU a
        device generator seeded with the row's seed (so every rank and stage draws alike)."""
        device = self.model.device
        if device.type == "cpu":
            return row.generator
        return torch.Generator(device).manual_seed(request_seed(row.request.seed, row.request.id))

    @staticmethod
    def _limit(row: ARRow, sampling: SamplingParams) -> int:
        """The row's budget of generated tokens (a forced CoT length caps it)."""
        return sampling.max_new_tokens if row.forced_length is None else min(sampling.max_new_tokens,
                                                                             row.forced_length)

    def choice(self, row: ARRow, sampling: SamplingParams) -> str | int:
        """How a live row's next token is chosen: "pending" (a forced stage transition), "ratio"
        (the greedy ratio choice), a closing token id (out of budget), or "sample"."""
        if row.pending:  # official stage-transition processor
            return "pending"
        if row.ratio_trigger is not None and row.last == row.ratio_trigger:
            return "ratio"
        if row.bot_task != "auto":
            closing = self._closing_path(row)
            if closing and len(row.generated) + len(closing) >= self._limit(row, sampling):
                return closing[0]  # out of budget: close the CoT (see module docstring)
        return "sample"

    def advance(self, row: ARRow, sampling: SamplingParams, picked: tuple[int, int] | None,
                how: str | int | None = None) -> int | None:
        """Take the row's next token; None when the row is finished (or just finished: the stop
        token is recorded but never fed). `picked`: the (greedy ratio choice, sampled token) the
        scheduler's DeviceSampler computed for this row; needed when `choice` says "ratio" or
        "sample". `how`: `choice`'s answer when the caller already asked it."""
        if row.done:
            return None
        how = how if how is not None else self.choice(row, sampling)
        if how == "pending":
            token = row.pending.pop(0)
        elif how in ("ratio", "sample"):
            if picked is None:
                raise ValueError(f"row {row.request.id}: its next token is a {how} choice and none was picked")
            token = picked[0] if how == "ratio" else picked[1]  # ratio: the official force_greedy slice
        else:
            token = how
        row.generated.append(token)
        row.last = token
        if not row.pending and token in row.transitions and token not in row.completed:
            row.completed.add(token)  # a stage transition fires once per tag
            row.pending = list(row.transitions[token])
        if token in row.stop_ids or (row.bot_task == "auto" and len(row.generated) >= self._limit(row, sampling)):
            row.done = True
            return None
        return token

    def _closing_path(self, row: ARRow) -> list[int]:
        """The shortest token path from the row's state to its stop: pending forced tokens, the
        remaining end tags in order (with their transitions), the ratio token."""
        path: list[int] = []
        last, pending, completed = row.last, list(row.pending), set(row.completed)
        seen = set(row.generated)
        for _ in range(64):
            if pending:
                t = pending.pop(0)
            elif row.ratio_trigger is not None and last == row.ratio_trigger:
                t = self.tok.ratio_choice_ids[0]  # any ratio token: it stops the row
            else:
                todo = [tag for tag in row.closing_tags if tag not in seen]
                if not todo:
                    break
                t = todo[0]
            path.append(t)
            seen.add(t)
            if not pending and t in row.transitions and t not in completed:
                completed.add(t)
                pending = list(row.transitions[t])
            if t in row.stop_ids:
                break
            last = t
        return path

    def finish_row(self, row: ARRow, b: int, cache) -> AROutput:
        """The finished row's AROutput; with `cache` (its K/V in batch row `b`), its prompt K/V too."""
        tok, req = self.tok, row.request
        footprints = [c.footprint for c in row.cond]
        out = AROutput(id=req.id, user_text=req.prompt, system_prompt=row.system_prompt, bot_task=row.bot_task,
                       cond_images=footprints, prompt_ids=list(row.seq.cond_ids), generated_ids=list(row.generated),
                       cot_text="", ratio_index=-1, image_size=(0, 0),
                       drop_think=self.generation_config.drop_think,
                       infer_align_image_size=req.infer_align_image_size, seed=request_seed(req.seed, req.id))
        if row.bot_task == "auto":
            answer = row.generated[:-1] if row.generated and row.generated[-1] in row.stop_ids else row.generated
            out.answer_text = tok.decode(answer)
            return out

        if row.fixed_ratio is not None:
            out.ratio_index = row.fixed_ratio
        else:
            out.ratio_index = tok.ratio_ids.index(row.generated[-1])
        out.image_size = self.builder.resolutions.size(out.ratio_index)
        if row.bot_task != "image":
            out.cot_text, out.system_prompt = self._cot_text(row)
        seq = out.dit_sequence(self.builder)
        cut = first_difference(out.fed_ids, seq.cond_ids)
        out.reencode_diff_at = cut if cut < seq.reuse_boundary else None
        if cache is not None:
            out.prompt_kv = self._export(row, b, cache, seq)
        return out

    def _cot_text(self, row: ARRow) -> tuple[str, str]:
        """(cot_text, system prompt) as the official generate_image: the trigger tag + the decoded
        generated tokens through the first end token; drop_think keeps the recaption part only and
        switches a system prompt to en_recaption."""
        tok = self.tok
        end = tok.recaption_end if "recaption" in row.bot_task else tok.think_end
        gen = row.generated
        cot_ids = gen[:gen.index(end) + 1] if end in gen else gen
        trigger = "<think>" if row.bot_task.startswith("think") else "<recaption>"
        cot_text = trigger + tok.decode(cot_ids)
        system_prompt = row.system_prompt
        if self.generation_config.drop_think and "<think>" in cot_text and "<recaption>" in cot_text:
            part = cot_text.split("<recaption>")[1]
            if "</recaption>" in part:
                part = part.split("</recaption>")[0]
            cot_text = "<recaption>" + part + "</recaption>"
            if system_prompt:
                system_prompt = self.system_prompts["en_recaption"]  # official: not stripped here
        return cot_text, system_prompt

    def _export(self, row: ARRow, b: int, cache, full: Sequence) -> PromptKV | None:
        """K/V of the cond row's first pos_reuse_len tokens, as [tokens, kv_heads, head_dim] per layer."""
        n = full.pos_reuse_len
        if n == 0:
            return None
        lo = row.offset
        # a copy even where the view already counts as contiguous (one KV head per rank): the
        # scheduler gives the row's cache slot to the next row while this payload is being put
        keys = [k[b, :, lo:lo + n].transpose(0, 1).clone(memory_format=torch.contiguous_format) for k in cache.k]
        values = [v[b, :, lo:lo + n].transpose(0, 1).clone(memory_format=torch.contiguous_format) for v in cache.v]
        return PromptKV(keys, values, full.cond_ids[:n], n, full.neg_reuse_len, self.model_id, self.config_hash)
