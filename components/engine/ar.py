"""AR stage: batched prefill + chain-of-thought decode + ratio token, with prompt-KV export.

Per row the decoder walks a fixed list of stages (bot_task):

    think_recaption:  <think> COT </think>  -> forced <recaption> -> COT </recaption> -> answer prefix -> ratio
    think:            <think> COT </think>                                            -> answer prefix -> ratio
    recaption:        <recaption> COT </recaption>                                    -> answer prefix -> ratio
    image:            (prompt already ends with the answer prefix)                                     -> ratio

The answer prefix `<answer><boi><img_size_B>` is forced after the last end tag; the ratio token is
the greedy choice among ratio tokens (or forced when the request fixed a size). Rows of different
lengths are left-padded; padding keys are masked, so a row's tokens do not depend on its batch.
"""

from __future__ import annotations

import copy
import time
import zlib
from dataclasses import asdict, dataclass, field, fields

import torch
from PIL import Image

from .inputs import EncodedImage, embed_span, encode_cond_images
from .kvcache import PromptKV
from .sequence import SYSTEM_PROMPTS, CondImage, Sequence, SequenceBuilder
from .tokenizer import Tokenizer
from .transformer import HunyuanImage3ForCausalMM, attention_mask


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    max_new_tokens: int = 48  # CoT budget per stage; the end tag is forced when it runs out


@dataclass
class ARRequest:
    id: str
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    image_size: str | tuple[int, int] = "auto"  # "auto" lets the model pick the ratio token
    bot_task: str = "think_recaption"
    system_prompt: str = "en_unified"  # a key of SYSTEM_PROMPTS, or the text itself
    seed: int | None = None


@dataclass
class AROutput:
    id: str
    user_text: str
    system_prompt: str  # the resolved text
    bot_task: str
    cond_images: list[CondImage]
    prompt_ids: list[int]
    generated_ids: list[int]  # forced tags included; the last one is the ratio token
    assistant_ids: list[int]  # everything after `Assistant: ` (trigger + generated)
    cot_text: str
    ratio_index: int
    image_size: tuple[int, int]  # (width, height)
    prompt_kv: PromptKV | None = None
    timings: dict = field(default_factory=dict)

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
                                        c["vit_len"]) for c in rec.get("cond_images") or []]
        rec["image_size"] = tuple(rec["image_size"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in rec.items() if k in known})


def resolve_system_prompt(name_or_text: str) -> str:
    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def request_seed(seed: int | None, request_id: str) -> int:
    """The request's seed, or a stable one derived from its id."""
    return seed if seed is not None else zlib.crc32(request_id.encode())


@dataclass
class _Row:
    request: ARRequest
    seq: Sequence
    cond: list[EncodedImage]
    stages: list[tuple]
    generator: torch.Generator
    forced_ratio: int | None
    offset: int = 0  # left padding
    generated: list[int] = field(default_factory=list)
    stage_tokens: int = 0
    done: bool = False


class ARGenerator:
    def __init__(self, model: HunyuanImage3ForCausalMM, tokenizer: Tokenizer, builder: SequenceBuilder,
                 model_id: str = "") -> None:
        self.model, self.tok, self.builder = model, tokenizer, builder
        self.model_id = model_id
        self.config_hash = model.config.config_hash()

    # -- public -------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, requests: list[ARRequest], sampling: SamplingParams | None = None,
                 export_kv: bool = True) -> list[AROutput]:
        sampling = sampling or SamplingParams()
        rows = [self._prepare(r) for r in requests]

        t0 = time.perf_counter()
        cache, logits, valid = self._prefill(rows, sampling)
        t1 = time.perf_counter()
        steps = self._decode(rows, cache, logits, valid, sampling)
        t2 = time.perf_counter()

        outputs = []
        for b, row in enumerate(rows):
            out = self._finish(row, b, cache if export_kv else None)
            out.timings = {"ar_prefill_s": t1 - t0, "ar_decode_s": t2 - t1, "ar_batch_size": len(rows),
                           "ar_decode_steps": steps, "prompt_tokens": len(row.seq.cond_ids),
                           "generated_tokens": len(row.generated)}
            outputs.append(out)
        return outputs

    # -- stages -------------------------------------------------------------------------------
    def _prepare(self, req: ARRequest) -> _Row:
        tok = self.tok
        cond = encode_cond_images(self.model, self.builder, req.images) if req.images else []
        seq = self.builder.ar_prompt(req.prompt, [c.footprint for c in cond], req.bot_task,
                                     resolve_system_prompt(req.system_prompt))
        answer_prefix = ("force", [tok.answer, tok.boi, tok.size_id(self.builder.base_size)])
        stages = {
            "think_recaption": [("cot", tok.think_end), ("force", [tok.recaption]), ("cot", tok.recaption_end),
                                answer_prefix],
            "think": [("cot", tok.think_end), answer_prefix],
            "recaption": [("cot", tok.recaption_end), answer_prefix],
            "image": [],
        }[req.bot_task] + [("ratio",)]
        forced_ratio = None
        if req.image_size != "auto":
            width, height = req.image_size
            forced_ratio = self.builder.resolutions.index_of(width, height)
            if forced_ratio is None:
                raise ValueError(f"request {req.id}: image size {width}x{height} is not a supported bucket")
        gen = torch.Generator().manual_seed(request_seed(req.seed, req.id))
        return _Row(req, seq, cond, stages, gen, forced_ratio)

    def _prefill(self, rows: list[_Row], sampling: SamplingParams):
        model, tok = self.model, self.tok
        length = max(len(r.seq.cond_ids) for r in rows)
        budget = max(sum(sampling.max_new_tokens + 1 if s[0] == "cot" else len(s[1]) if s[0] == "force" else 1
                         for s in row.stages) for row in rows) + 8  # rows may have different bot_tasks
        batch = len(rows)
        x = model.embed_ids(torch.full((batch, length), tok.pad, device=model.device)).clone()
        positions = torch.zeros(batch, length, 2, dtype=torch.float64)
        blocks = torch.full((batch, length), -1, dtype=torch.long)
        valid = torch.zeros(batch, length + budget, dtype=torch.bool)  # which cache slots hold real tokens
        for b, row in enumerate(rows):
            n = len(row.seq.cond_ids)
            row.offset = length - n
            x[b, row.offset:] = embed_span(model, row.seq.cond_ids, row.seq, 0, n, row.cond)
            positions[b, row.offset:] = row.seq.positions()
            blocks[b, row.offset:] = row.seq.block_ids()
            valid[b, row.offset:length] = True
        slots = torch.arange(length).expand(batch, length)
        mask = attention_mask(slots, slots, blocks, blocks, valid[:, :length]).to(model.device)
        cache = model.new_cache(batch, valid.shape[1])
        hidden = model.forward_layers(x, positions.to(model.device), mask, cache)
        cache.commit()
        return cache, model.text_logits(hidden[:, -1]), valid

    def _decode(self, rows: list[_Row], cache, logits: torch.Tensor, valid: torch.Tensor,
                sampling: SamplingParams) -> int:
        model, tok = self.model, self.tok
        steps = 0
        while True:
            next_ids = [self._next_token(row, logits[b], sampling) for b, row in enumerate(rows)]
            if all(row.done for row in rows):
                return steps
            slot = cache.length
            feed = torch.tensor([[t if t is not None else tok.pad] for t in next_ids], device=model.device)
            for b, (row, t) in enumerate(zip(rows, next_ids)):
                valid[b, slot] = t is not None  # finished rows feed a masked pad
            positions = torch.tensor([[[slot - r.offset] * 2] for r in rows], dtype=torch.float64)
            k_slots = torch.arange(slot + 1).expand(len(rows), slot + 1)
            q_slots = torch.full((len(rows), 1), slot)
            no_block = torch.full((len(rows), slot + 1), -1)
            mask = attention_mask(q_slots, k_slots, no_block[:, :1], no_block, valid[:, :slot + 1])
            hidden = model.forward_layers(model.embed_ids(feed), positions.to(model.device),
                                          mask.to(model.device), cache)
            cache.commit()
            logits = model.text_logits(hidden[:, -1])
            steps += 1

    def _next_token(self, row: _Row, logits: torch.Tensor, sampling: SamplingParams) -> int | None:
        """Pick row's next token from its current stage; None once the row is finished."""
        if row.done:
            return None
        tok = self.tok
        stage = row.stages[0]
        if stage[0] == "ratio":
            if row.forced_ratio is not None:
                ratio = row.forced_ratio
            else:
                ratio = int(logits[tok.ratio_ids].argmax())
            row.generated.append(tok.ratio_ids[ratio])
            row.done = True
            return None  # the ratio token is chosen, never fed
        if stage[0] == "force":
            token = stage[1][0]
            rest = stage[1][1:]
            row.stages[0] = ("force", rest)
            if not rest:
                row.stages.pop(0)
        else:  # cot
            end_tag = stage[1]
            if row.stage_tokens >= sampling.max_new_tokens:
                token = end_tag
            else:
                token = self._sample(logits, end_tag, sampling, row.generator)
            row.stage_tokens += 1
            if token == end_tag:
                row.stages.pop(0)
                row.stage_tokens = 0
        row.generated.append(token)
        return token

    def _sample(self, logits: torch.Tensor, end_tag: int, sampling: SamplingParams,
                generator: torch.Generator) -> int:
        logits = logits.float().cpu().clone()
        banned = [i for i in self.tok.special_ids if i != end_tag and i < logits.shape[0]]
        logits[banned] = float("-inf")
        logits[self.tok.vocab_size:] = float("-inf")  # padded vocab rows are never tokens
        if sampling.temperature <= 0:
            return int(logits.argmax())
        logits = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = logits.topk(min(sampling.top_k, logits.shape[0])).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cut = sorted_probs.cumsum(0) - sorted_probs > sampling.top_p
            sorted_probs[cut] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _finish(self, row: _Row, b: int, cache) -> AROutput:
        tok, seq = self.tok, row.seq
        assistant_ids = seq.cond_ids[seq.assistant_start:] + row.generated
        ratio_index = tok.ratio_ids.index(row.generated[-1])
        system_prompt = resolve_system_prompt(row.request.system_prompt)
        footprints = [c.footprint for c in row.cond]
        cot_ids = [t for t in assistant_ids if t not in tok.special_ids]
        out = AROutput(
            id=row.request.id, user_text=row.request.prompt, system_prompt=system_prompt,
            bot_task=row.request.bot_task, cond_images=footprints, prompt_ids=list(seq.cond_ids),
            generated_ids=list(row.generated), assistant_ids=assistant_ids,
            cot_text=tok.decode(cot_ids), ratio_index=ratio_index,
            image_size=self.builder.resolutions.size(ratio_index))
        if cache is not None:
            full = self.builder.dit_sequence(out.user_text, footprints, assistant_ids, system_prompt, ratio_index)
            out.prompt_kv = self._export(row, b, cache, full)
        return out

    def _export(self, row: _Row, b: int, cache, full: Sequence) -> PromptKV | None:
        """K/V of the cond row's first pos_reuse_len tokens, as [tokens, kv_heads, head_dim] per layer."""
        n = full.pos_reuse_len
        if n == 0:
            return None
        lo = row.offset
        keys = [k[b, :, lo:lo + n].transpose(0, 1).contiguous() for k in cache.k]
        values = [v[b, :, lo:lo + n].transpose(0, 1).contiguous() for v in cache.v]
        return PromptKV(keys, values, full.cond_ids[:n], n, full.neg_reuse_len, self.model_id, self.config_hash)
