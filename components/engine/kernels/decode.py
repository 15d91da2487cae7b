"""AR decode with static shapes and CUDA graphs, and sampling on the device (issue 12, item 3).

The plain decode step (the removed static batch loop's; tests/test_kernels_decode.py keeps it as
the reference, `_plain_step`) slices the KV cache to the filled length and builds a fresh mask on
the host for every token, so its shapes change every step and every step pays the launch cost of a
few hundred small kernels. `StaticDecoder` runs a step whose shapes stay fixed
over a whole span of tokens, so one CUDA graph per (batch bucket, span) replays it:

- the batch is padded up to a bucket (1, 2, 4, ..., 64): the KV cache is allocated with that many
  rows (`KVCache(rows=...)`); a padded row feeds a pad token and sees only itself;
- the step's inputs (tokens, which rows are live, the cache slot) are one int64 device buffer,
  filled by one host-to-device copy; the new K/V is written at the slot with `index_copy_`;
- attention covers a fixed span of cache slots (the filled length rounded up to SPAN_STEP, at most
  the capacity) under a device validity mask: left padding, finished rows' masked pads and unused
  slots are masked, and a query always sees its own slot, as in `attention_mask`;
- RoPE positions are the slot minus each row's left padding, computed on the device;
- attention reads each row up to its own length (kernels/decode_attention.py, a split-KV Triton
  kernel: under continuous batching the span is the longest row's), or where that kernel does not
  run (the CPU, `decode_attention=sdpa`) SDPA with the mask, the query heads of each KV group passed
  as `groups` queries of one head (equal head counts: a fused kernel whose replays matched the eager
  step bitwise);
- the layers' norms, projections, RoPE and MoE run through the compiled regions of
  kernels/compiled_layers.py (`compile=auto|on`), one graph dynamic in the batch.

On CUDA in bf16 one graph is captured per span and replayed; elsewhere the same step runs
eagerly (the CPU tests compare it with the plain path). Tensor-parallel ranks' graphs hold the
NCCL all-reduces of every layer, and the ranks agree on each capture (all replay, or all run
eagerly); their MoE runs decode-size batches at static shapes (parallel.STATIC_ROUTING_TOKENS).
Pipeline stages (without TP) graph their own layers only: the hand-offs between stages stay outside
the graph (`StaticDecoder._start_stage`), so each stage decides alone whether its graph captured.
The graphs belong to one `StaticDecoder`, i.e. to one AR batch: they hold the addresses of its KV
cache and are captured again for the next.

`DeviceSampler` picks every row's token on the logits' device, with one host copy per step.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import decode_attention, enabled, is_kernel_failure, record_fallback, run_fast, settings

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPAN_STEP = 1024  # attention span granularity: a new graph every SPAN_STEP tokens


def batch_bucket(batch: int) -> int:
    """The padded batch a static decode step runs: the next bucket, or a multiple of the largest."""
    for b in BATCH_BUCKETS:
        if batch <= b:
            return b
    top = BATCH_BUCKETS[-1]
    return -(-batch // top) * top


def decode_mode(model) -> str:
    """"plain", "eager" (the static step without graphs) or "graphs". The AR scheduler replays CUDA
    graphs for "graphs" and runs the static step eagerly otherwise.

    `decode_graphs=auto` picks graphs for CUDA bf16; `on` forces the static step anywhere (eager on
    the CPU and in other dtypes, whose per-expert MoE loop reads counts back to the host and so
    cannot be captured). Pipeline stages graph their own layers, as one GPU does (`off`: the plain
    step). Tensor-parallel ranks capture each layer's NCCL all-reduces into the graph (not under
    pipeline stages as well: those ranks decode plainly). What each gains: docs/benchmarks.md."""
    weight = model.model.wte.weight
    parallel = getattr(model, "parallel", None)
    if parallel is not None and parallel.world_size > 1 and parallel.pp_size > 1:
        return "plain"
    if not enabled("decode_graphs", weight, "on"):
        return "plain"
    return "graphs" if weight.is_cuda and weight.dtype == torch.bfloat16 else "eager"


# Attention of the static step: each KV group's query heads become `groups` queries of one head,
# so SDPA sees equal head counts and its fused kernel reads each K/V block once per group; its
# graph replays were bitwise equal to the eager step in every measurement. SDPA's own
# masked GQA (what the plain step runs) is faster at small batches (one layer, KV 6.8k, H100: 24 vs
# 153 us at batch 1, 98 vs 162 at 8, 634 vs 670 at 64) but its results differed between a replay
# and the eager step (max abs 0.59 after 4 layers at batch 1), so it is used only below this many
# (row, KV head) pairs: 0, i.e. never, by default (docs/benchmarks.md).
GROUPED_FROM = 0


class DecodeMask:
    """Validity mask of a one-token decode step, keep [B, 1, 1, S] over the static span of the
    cache, and each row's length kv_len [B] (its write slot + 1: no later slot is kept); computes
    the attention itself (`transformer.attend` defers to `attend`).

    On CUDA (`decode_attention=auto|split`) the split-KV kernel reads each row up to its length
    only (kernels/decode_attention.py); SDPA reads the whole span of every row. A kernel failure
    falls back to SDPA for that shape."""

    def __init__(self, keep: torch.Tensor, kv_len: torch.Tensor | None = None) -> None:
        self.keep, self.kv_len = keep, kv_len

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_len is not None and enabled("decode_attention", q, "split"):
            if decode_attention.supported(q, k):
                return run_fast("decode_attention", (q.shape[0], q.shape[1], k.shape[1], k.shape[2], q.dtype),
                                lambda: decode_attention.split_kv_attention(q, k, v, self.keep, self.kv_len),
                                lambda: self.sdpa(q, k, v))
        return self.sdpa(q, k, v)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, heads, t, d = q.shape  # t == 1
        kv_heads = k.shape[1]
        if b * kv_heads < GROUPED_FROM:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep, enable_gqa=True)
        grouped = q.reshape(b, kv_heads, heads // kv_heads * t, d)  # head h -> group h // groups
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=self.keep)
        return out.reshape(b, heads, t, d)


class _SlotWriter:
    """Stands in for the KVCache in `Attention.forward`: writes the step's K/V at each row's device
    slot and returns the static span of the cache rows."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], slots: torch.Tensor, span: int,
                 first_layer: int = 0) -> None:
        self.k, self.v, self.span = k, v, span
        self.slots = slots  # [rows] the slot each row writes
        self.first_layer = first_layer  # a pipeline stage's cache holds its own layers only

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer -= self.first_layer
        at = self.slots.view(-1, 1, 1, 1).expand(k.shape)  # k [rows, kv_heads, 1, head_dim]
        self.k[layer].scatter_(2, at, k)
        self.v[layer].scatter_(2, at, v)
        return self.k[layer][:, :, :self.span], self.v[layer][:, :, :self.span]


def _capture_autocast():
    """The ambient autocast, without its cast cache: a cast cached outside the capture would be
    baked into the graph by address and freed when the autocast context exits."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


@dataclass
class _InFlight:
    """A decode step `StaticDecoder.start` began: its logits, or under pipeline stages the model's
    StageWork of it."""

    rows: int
    logits: torch.Tensor | None = None
    stages: object = None


class StaticDecoder:
    """Decode steps at static shapes over a KV cache's rows (see the module docstring).

    cache: the prefilled KVCache (its `k_rows` are the rows a step may run over); valid [batch,
    capacity] bool: which slots hold real tokens after the prefill; offsets: each row's left
    padding; graphs: capture and replay CUDA graphs (else run the same step eagerly).

    A step feeds rows [lo, lo + n) of the cache, padded to a batch bucket (at most the cache's rows),
    each row writing its own slot: a static batch passes no slots (all rows write `cache.length`);
    the continuous-batching scheduler (engine/ar_scheduler.py) passes each row's own length. One
    graph per (first row, padded batch, span); all graphs share one memory pool.
    """

    def __init__(self, model, cache, valid: torch.Tensor, offsets: list[int], pad_id: int,
                 graphs: bool) -> None:
        self.model, self.cache = model, cache
        self.batch = len(offsets)
        self.rows = cache.k_rows[0].shape[0]
        self.capacity = cache.k_rows[0].shape[2]
        self.pad_id = pad_id
        self.use_graphs = graphs
        device = model.device
        n = self.rows
        self.valid = torch.zeros(n, self.capacity, dtype=torch.bool, device=device)
        self.valid[:self.batch] = valid.to(device)
        offs = torch.full((n,), cache.length, dtype=torch.long)  # padded rows: positions from 0
        offs[:self.batch] = torch.tensor(offsets, dtype=torch.long)
        self.offsets = offs.to(device)
        self.slots = torch.arange(self.capacity, device=device)
        # per step: token ids [n], live flags [n], each row's cache slot [n]
        self.inputs = torch.zeros(3 * n, dtype=torch.long, device=device)
        # the host side of that copy, one per first row: under pipeline stages the scheduler starts
        # the next row group's step before the last one's copy has run (`start`); each buffer is
        # written again only once its last copy has run (`_copied`)
        self._host: dict[int, torch.Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}
        self.stages = model.pipeline  # under pipeline stages, run() hands hidden states between them
        self.stage_in: torch.Tensor | None = None  # a later stage's static input (what the stage before sent)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs and device.type == "cuda" else None
        self.graph_error: str | None = None
        # the layers' compiled regions (kernels/compiled_layers.py: norms, projections, RoPE, MoE
        # fused around the attention); under pipeline stages, of the stage's layers
        self.compiled = enabled("compile", model.model.wte.weight, "on")

    def span(self, slot: int) -> int:
        """How many cache slots the step whose highest write is at `slot` attends over."""
        return min(self.capacity, -(-(slot + 1) // SPAN_STEP) * SPAN_STEP)

    def forward(self, span: int, lo: int = 0, n: int | None = None) -> torch.Tensor:
        """The static step on the current `inputs`: logits [n, vocab] (float32). Captured as is."""
        return self.model.text_logits(self.layers(span, lo, n)[:, -1])

    def layers(self, span: int, lo: int = 0, n: int | None = None) -> torch.Tensor:
        """The decoder layers of the static step over cache rows [lo, lo + n): last hidden states
        [n, 1, hidden]."""
        model, n = self.model, self.rows if n is None else n
        ids, live, slot = self.inputs[:n], self.inputs[n:2 * n] != 0, self.inputs[2 * n:3 * n]
        valid = self.valid[lo:lo + n]
        valid.scatter_(1, slot.view(n, 1), live.view(n, 1))  # finished and padded rows feed masked pads
        keep = valid[:, :span] | (self.slots[:span] == slot.view(n, 1))  # a query always sees itself
        positions = (slot - self.offsets[lo:lo + n]).to(torch.float64).view(n, 1, 1).expand(n, 1, 2)
        writer = _SlotWriter([k[lo:lo + n] for k in self.cache.k_rows], [v[lo:lo + n] for v in self.cache.v_rows],
                             slot, span, self.cache.first_layer)
        mask = DecodeMask(keep.view(n, 1, 1, span), slot + 1)
        # under pipeline stages this stage's layers only (`_start_stage` hands off between stages);
        # a later stage starts from what the stage before sent
        later_stage = self.stages is not None and self.stages.pp_rank > 0
        x = self.stage_in[:n] if later_stage else model.embed_ids(ids.view(n, 1))
        return model.forward_layers(x, positions, mask, writer, compiled=self.compiled, layers=model.stage_layers)

    def set_inputs(self, tokens: list[int | None], slots: list[int] | None = None, n: int | None = None,
                   lo: int = 0) -> int:
        """Copy one step's inputs for n rows (default: all) to the device (None: a row that feeds a
        masked pad); each row writes at its slot (default: the cache's length). The highest slot."""
        n = self.rows if n is None else n
        slots = [self.cache.length] * n if slots is None else slots
        if max(slots) >= self.capacity:
            raise RuntimeError(f"KV cache overflow: {max(slots) + 1} > capacity {self.capacity}")
        pad = n - len(tokens)
        ids = [self.pad_id if t is None else t for t in tokens] + [self.pad_id] * pad
        live = [int(t is not None) for t in tokens] + [0] * pad
        cuda = self.inputs.device.type == "cuda"
        host = self._host.get(lo)
        if host is None:
            host = self._host[lo] = torch.zeros(3 * self.rows, dtype=torch.long, pin_memory=cuda)
        if lo in self._copied:
            self._copied[lo].synchronize()  # the copy from this buffer queued last time has run
        host[:3 * n].copy_(torch.tensor(ids + live + list(slots), dtype=torch.long))
        self.inputs[:3 * n].copy_(host[:3 * n], non_blocking=True)
        if cuda:
            self._copied.setdefault(lo, torch.cuda.Event()).record()
        return max(slots)

    def step(self, tokens: list[int | None], slots: list[int] | None = None, lo: int = 0) -> torch.Tensor:
        """Feed one token per row of rows [lo, lo + len(tokens)); the next logits [len(tokens),
        vocab]. Without `slots` every row writes at the cache's length, which then advances by one
        (as `KVCache.commit` after a plain step). With graphs, the logits are a static buffer that
        the next step overwrites."""
        return self.land(self.start(tokens, slots, lo))

    def start(self, tokens: list[int | None], slots: list[int] | None = None, lo: int = 0,
              hi: int | None = None) -> "_InFlight":
        """`step` up to the logits, which `land` then gives: under pipeline stages this stage's
        part is queued and its output sent on without waiting, so the scheduler can start another
        row group's step (rows [lo, hi), default up to the last row) while this one is in later
        stages. The padded batch stays inside [lo, hi)."""
        n = min(batch_bucket(len(tokens)), (self.rows if hi is None else hi) - lo)
        if slots is None:
            padded = [self.cache.length] * n
        else:
            padded = list(slots) + [0] * (n - len(slots))  # spare rows are free: their slot 0 is written later
        top = self.set_inputs(tokens, padded, n, lo)
        span = self.span(top)
        if slots is None:
            self.cache.length = top + 1
        if self.stages is None:
            return _InFlight(len(tokens), logits=self.run(span, lo, n))
        return self._start_stage(span, lo, n, len(tokens))

    def run(self, span: int, lo: int = 0, n: int | None = None) -> torch.Tensor:
        """The static step on the current `inputs` in one process: the logits, replayed from its graph."""
        n = self.rows if n is None else n
        return self._graphed((lo, n, span), lambda: self.forward(span, lo, n))

    def land(self, step: "_InFlight") -> torch.Tensor:
        """The logits [rows fed, vocab] of a step `start` began."""
        if step.logits is None:
            step.logits = self.model.text_logits(self.model.stages.land(step.stages))
        return step.logits[:step.rows]

    def _start_stage(self, span: int, lo: int, n: int, rows: int) -> "_InFlight":
        """This stage's layers of the step (its own graph) between the hand-offs, without waiting
        for the later stages (`PipelineStages.start`): a later stage first copies what the stage
        before sent into its static input. The last stage sends the rows' last hidden states back
        to every stage, so every stage makes the same logits and takes the same decisions."""
        def stage(got: torch.Tensor | None) -> torch.Tensor:
            if got is not None:
                if self.stage_in is None:  # the dtype the stage before sends (its output may be wider)
                    self.stage_in = torch.empty((self.rows, *got.shape[1:]), dtype=got.dtype, device=got.device)
                self.stage_in[:n].copy_(got)
            return self._graphed((lo, n, span), lambda: self.layers(span, lo, n))

        return _InFlight(rows, stages=self.model.stages.start(None, stage))

    def _graphed(self, key: tuple, fn) -> torch.Tensor:
        """fn() (an idempotent static step) replayed from its CUDA graph, captured on first use; or
        run eagerly without graphs, or once a capture failed."""
        if not self.use_graphs:
            return fn()
        entry = self.graphs.get(key)
        if entry is None:
            tp = getattr(self.model, "parallel", None)
            tp = tp if tp is not None and tp.world_size > 1 else None
            error = None
            try:
                # thread-local capture: other threads go on meanwhile (NCCL's watchdog polling its
                # events under stages or TP; an overlapped job's DiT on its own stream; K/V puts)
                entry = self.capture(fn, self.pool, "thread_local")
            except RuntimeError as e:  # an op that syncs with the host cannot be captured
                if not is_kernel_failure(e):
                    raise  # out of memory, a lost rank: not the graph's failure
                error = e
            # tensor-parallel ranks all replay or all run eagerly: a capture executes none of its
            # all-reduces, so either way every rank's next ones pair up
            if tp is not None and not tp.all_true(error is None):
                error = error or RuntimeError("another tensor-parallel rank's capture failed")
            if error is not None:
                record_fallback("decode_graphs", (self.rows, key[-1]), error)
                warnings.warn(f"decode graphs: capture failed, decoding eagerly ({error})", stacklevel=2)
                self.graph_error, self.use_graphs = str(error), False
                torch.cuda.synchronize()
                return fn()
            self.graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out

    @staticmethod
    def capture(fn, pool=None, mode: str = "thread_local") -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A CUDA graph of fn() (an idempotent static step) and its output buffer."""
        # warm up on a side stream first: lazy initialisations (cuBLAS handles, workspaces) must
        # not happen during capture. The step is idempotent (same K/V at the same slot), so the
        # warm-up, and the replay that follows the capture, compute the same thing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _capture_autocast():
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with _capture_autocast(), torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
            out = fn()
        return graph, out


class DeviceSampler:
    """HF `generate`'s choice for all rows at once on the logits' device, one host copy per step.

    Over the whole output vocabulary, as the official pipeline (HF `generate`): ids at or above the
    tokenizer's length are tokens like any other (the tokenizer's decode skips them, as the official
    one does). Greedy: argmax. Sampled: temperature -> top-k -> top-p (HF's warper semantics: top-k
    keeps ties with the k-th score; top-p drops the ascending-sorted tokens whose cumulative
    probability is <= 1 - top_p, keeping at least one) -> one draw per row. The draw is the
    algorithm torch.multinomial uses for one sample (argmax of p / q with q ~ Exp(1)), with q drawn
    from the row's own generator, only for rows that sample this step: on the CPU with the same
    generator it picks the same token as `torch.multinomial(p, 1, generator)`, and a row's draws
    never depend on the other rows. On CUDA the tokens follow each row's CUDA generator (seeded with
    the row's seed), so they are reproducible per seed but differ from the CPU stream's.

    `banned`: ids never sampled (ARDIT_BENCH_COT_TOKENS: a forced CoT length, see ar.py).
    """

    def __init__(self, sampling, ratio_ids: list[int], generators: list[torch.Generator],
                 banned: list[int] | None = None) -> None:
        self.sampling, self.generators = sampling, generators
        self.ratio_ids = torch.tensor(ratio_ids, dtype=torch.long)
        self.banned = torch.tensor(banned or [], dtype=torch.long)
        if generators:
            self.ratio_ids = self.ratio_ids.to(generators[0].device)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Scores [B, V] float32 after temperature, top-k and top-p."""
        sp = self.sampling
        scores = logits.float().clone()
        if len(self.banned):
            scores[:, self.banned.to(scores.device)] = float("-inf")
        if sp.greedy:
            return scores
        scores = scores / sp.temperature
        if sp.top_k and sp.top_k > 0:
            kth = scores.topk(min(sp.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sp.top_p is not None and sp.top_p < 1.0:
            ascending, order = scores.sort(dim=-1)
            drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sp.top_p
            drop[:, -1:] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return scores

    def pick(self, logits: torch.Tensor, sample_rows: list[bool],
             generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
        """Tokens [B] on the device: argmax, or the multinomial draw for rows in `sample_rows`
        (with `generators[b]`, default the sampler's)."""
        generators = self.generators if generators is None else generators
        scores = self.warp(logits)
        if self.sampling.greedy or not any(sample_rows):
            return scores.argmax(dim=-1)
        probs = scores.softmax(dim=-1)
        noise = torch.ones_like(probs)
        for b, draw in enumerate(sample_rows):
            if draw:
                noise[b].exponential_(1, generator=generators[b])
        return (probs / noise).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, sample_rows: list[bool],
                 generators: list[torch.Generator | None] | None = None) -> list[tuple[int, int]]:
        """Per row (the greedy ratio choice among `ratio_ids`, the sampled token), in one copy."""
        ratio_ids = self.ratio_ids.to(logits.device)
        ratio = ratio_ids[logits[:, ratio_ids].float().argmax(dim=-1)]
        both = torch.stack([ratio, self.pick(logits, sample_rows, generators)], dim=1)
        return [tuple(r) for r in both.tolist()]
