"""Continuous batching for the AR stage, as vLLM schedules: a K/V budget, rows that join and leave
the decode batch at any step, chunked prefill, and an OOM that shrinks the batch instead of failing
rows.

    waiting --admit--> prefilling (one chunk per step) --> running (one token per step) --> finished
      ^                                                                                  |
      +------------- on OOM: in-flight rows go back, the admission budget halves --------+

- K/V lives in a slot pool: a KVCache whose batch rows are slots, each holding one row's prompt and
  CoT left-aligned, so rows of any length and age share it. A row takes the lowest free slot; the
  decode step runs over slots [0, highest used] padded to a batch bucket (kernels/decode.py), each
  row writing its own next slot, so the CUDA graphs of the static step keep working as rows come
  and go. A finished row's K/V is exported and handed to `on_result` at once, and its slot is free
  for the next waiting row.
- Admission: a row is admitted while the pool has a free slot within the budget: `max_rows` (the
  `--batch-size` cap) and the K/V bytes (`--gpu-memory-utilization` of the GPU, less what is in use
  after the weights load and an activation reserve), and while `Admission.gate` (if any) lets it in:
  an overlapped job's AR waits there for its DiT to catch up (components/runtime/handoff.py). The pool's rows x capacity (the longest
  admitted prompt + the CoT budget, rounded up to the decode span) are sized to the budget.
- Prefill is per row, in chunks of at most `max_num_batched_tokens` (an image block, whose tokens
  attend to each other both ways, is never split), one chunk per step between the decode steps, so
  a long edit prompt does not stall the decoding rows.
- A row's prefill is always its own; with `Admission.batch_invariant` (or the kernel setting
  `batch_invariant=on`) its decode steps are too (one step per row over its own slot), so its tokens
  and K/V are bitwise those it gets alone.
- Out of memory: the failed attempt's pool, graphs and in-flight rows are dropped, the allocator's
  cache emptied, the row cap halved, and the in-flight rows start again (their seeds give the same
  tokens). A row fails only when it does not fit alone, with its size and what would fit. The
  halved cap and budget land in `Admission.halved_to`; the AR step keeps them in the run, so a
  resume starts from the budget that last worked (components/ar/budget.py).
- Under tensor / pipeline parallelism a rank cannot retry a forward alone (the others wait in its
  collectives), but the pool is allocated outside any forward: every rank tries its pool, the ranks
  agree whether one ran out of memory, and all halve and allocate again alike. An OOM inside a
  forward still fails the step; the halved budget it leaves behind is what the resume starts from.
- Under pipeline stages every stage runs this loop and takes the same decisions. The pool's rows
  form one group per stage (kernel setting `stage_row_groups`) that decode in turn: a group's step starts
  through the stages without waiting (`StaticDecoder.start`), and its logits land on the group's
  next turn, so stage 0 works on group B while stage 1 works on group A. Prompt chunks (one in
  every group's turn) and the finished rows' K/V rewrites go through the stages without waiting
  too (a stage needs only its own layers' K/V of a row's earlier chunks); a prompt's last hidden
  state comes back from the last stage like a step's. Every stage lands what comes back in the
  order it started (`landing`). Conditioning images are encoded one row a stage and handed to
  stage 0, the only stage that embeds them (`_encode_ahead`).

Policy and runner: what a step does is decided without the model by `BatchPolicy` (engine/ar_policy.py,
tested without one in tests/test_ar_policy.py): from the queues, the slots, the pool and the gate's
answer it plans the rows admitted (each into a slot, or failed as too large), whether the pool must
grow, and each row group's turn (a prefill chunk, then the group's decode step); it also sizes the
pool and says what a failed step does, and halves the cap and budget. `ARScheduler` is the runner:
it keeps the queues and the pool, and does what needs the model or the device: it asks the gate,
prepares a row, allocates a pool, when the policy's plan asks it to, and runs the plan's chunks and
decode steps (choosing tokens from the logits, finishing rows, landing pipeline work, recovering
from a failure).
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import kernels
from .ar_policy import GATE, GROW, PREPARE, Admit, BatchPolicy, Chunk, StepPlan, StepState
from .inputs import EncodedImage, embed_span, encode_fitted, fit_cond_images
from .kernels.decode import SPAN_STEP, DeviceSampler, StaticDecoder
from .transformer import KVCache, SlotMask

CPU_ROWS = 8  # rows in flight on the CPU with --batch-size auto (no memory probe there)
DEFAULT_BATCHED_TOKENS = 2048  # prefill chunk (--max-num-batched-tokens)
CLOSING_MARGIN = 16  # K/V slots past max_new_tokens: forced closing tokens may exceed a tiny budget


# tests: called before every scheduler step with the scheduler; may raise torch.OutOfMemoryError
fault_hook: Callable[["ARScheduler"], None] | None = None
# tests: called before the K/V pool of `rows` slots is allocated; may raise torch.OutOfMemoryError
allocation_fault_hook: Callable[["ARScheduler", int], None] | None = None


def _wait_for_device(device: torch.device) -> None:
    """Wait for the work queued on this thread's stream. The next step's token choice reads the
    logits back anyway, so this costs only the few host microseconds that overlapped it; it makes
    each phase's timing (the row's `ar_prefill_s` / `ar_decode_s`, the stats) the device's time, not
    launch time. Only this stream: a DiT denoising on another stream of the same GPU (an overlapped
    job, components/overlap/) is not waited for."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class RowTooLarge(MemoryError):
    """A row whose K/V does not fit even alone (a transient error: another --tp / --pp / GPU fits it)."""


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, (torch.OutOfMemoryError, RowTooLarge))


def kv_bytes_per_token(model) -> int:
    """K and V of one token over this rank's KV heads and the layers of the largest pipeline stage
    (every stage must admit alike, so all size the pool for the fullest one)."""
    from .parallel import stage_layers

    attn = model.first_attention()  # this rank's heads; under pipeline parallelism, of its stage's layers
    pp = model.pipeline
    # stage 0 is the fullest: earlier stages take one more layer when the count does not divide
    layers = len(model.stage_layers if pp is None else stage_layers(model.config.num_hidden_layers, pp.pp_size, 0))
    return layers * 2 * attn.num_kv_heads * attn.head_dim * model.dtype.itemsize


def activation_reserve(model, chunk_tokens: int, max_rows: int = 64) -> int:
    """Bytes kept free for activations: a prefill chunk through one layer (attention, the routed
    experts' inputs and hidden states; a chunk grows to the end of an image block, up to a 1024x1024
    image's 4096 latent tokens), the decode graphs' pool and logits, plus 1 GiB of slack. An
    estimate: an OOM still only halves the batch."""
    chunk_tokens = max(chunk_tokens, 4096 + 1024)
    cfg = model.config
    topk = max(cfg.moe_topk) if isinstance(cfg.moe_topk, list) else cfg.moe_topk
    inter = max(cfg.moe_intermediate_size) if isinstance(cfg.moe_intermediate_size, list) \
        else cfg.moe_intermediate_size
    per_token = (12 * cfg.hidden_size + 3 * (topk + 1) * inter) * 4  # float32 worst case
    logits = max_rows * cfg.vocab_size * 4 * 3  # graph output, the scheduler's copy, the sampler's
    return chunk_tokens * per_token + logits + (1 << 30)


@dataclass
class Admission:
    """How many rows may be in flight: `max_rows` (a hard cap; None: the K/V budget decides),
    `kv_budget_bytes` (None: no byte limit) and the prefill chunk."""

    max_rows: int | None = None
    kv_budget_bytes: int | None = None
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    gpu_memory_utilization: float = 0.9
    # of the GPU memory in use when the budget was set, what PyTorch's allocator does not hold (the
    # CUDA context, libraries' kernels, NCCL's buffers; the fullest rank's): recorded per AR step
    outside_allocator_bytes: int | None = None
    # after an OOM, the (row cap, K/V budget bytes) the scheduler went on with: None without one
    halved_to: tuple[int, int | None] | None = None
    # every row decodes as its own batch of one (`--batch-invariant`): its tokens and K/V are bitwise
    # those it gets alone. None: the kernel setting batch_invariant decides
    batch_invariant: bool | None = None
    # asked before a waiting row is admitted, with the rows in flight: False holds it back for now
    # (an overlapped job's AR must not run far ahead of its DiT: components/runtime/handoff.py). It
    # may block while no row is in flight, until it says True; it may raise to stop the AR.
    gate: Callable[[int], bool] | None = None

    def at_most(self, max_rows: int | None, kv_budget_bytes: int | None) -> None:
        """Lower the row cap and K/V budget to these (None: no limit from them), e.g. to the budget
        that last worked for this run after an OOM."""
        if max_rows is not None:
            self.max_rows = max_rows if self.max_rows is None else min(self.max_rows, max_rows)
        if kv_budget_bytes is not None:
            self.kv_budget_bytes = kv_budget_bytes if self.kv_budget_bytes is None \
                else min(self.kv_budget_bytes, kv_budget_bytes)

    def decodes_alone(self) -> bool:
        """Whether each row's decode steps are its own (batch invariance)."""
        if self.batch_invariant is not None:
            return self.batch_invariant
        return kernels.settings().batch_invariant == "on"

    @classmethod
    def for_model(cls, model, batch_size: int | str = "auto", gpu_memory_utilization: float = 0.9,
                  max_num_batched_tokens: int | None = None, reserve_bytes: int = 0) -> "Admission":
        """Measured after the weights load: the GPU's total x utilization, less the memory in use
        (weights, other processes), the activation reserve and `reserve_bytes` (what a DiT beside
        this AR needs: an overlapped job). On the CPU: `CPU_ROWS` rows."""
        tokens = max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        cap = None if batch_size == "auto" else int(batch_size)
        if model.device.type != "cuda":
            return cls(cap or CPU_ROWS, None, tokens, gpu_memory_utilization)
        gc.collect()
        torch.cuda.empty_cache()  # blocks cached by an earlier step (a DiT in this process) are free memory
        free, total = torch.cuda.mem_get_info(model.device)
        budget = (int(total * gpu_memory_utilization) - (total - free) - activation_reserve(model, tokens)
                  - reserve_bytes)
        outside = (total - free) - torch.cuda.memory_reserved(model.device)
        parallel = getattr(model, "parallel", None)
        if parallel is not None:  # every rank admits alike, within the fullest rank's memory
            budget = parallel.agree_min(budget)
            outside = parallel.agree_max([outside])[0]
        return cls(cap, max(budget, 0), tokens, gpu_memory_utilization, outside)


@dataclass
class _Seq:
    """One request in the scheduler."""

    request: Any  # ARRequest
    order: int
    row: Any = None  # ar.ARRow once prepared
    slot: int = -1
    length: int = 0  # cache slots of its row filled
    need: int | None = None  # cache capacity it needs (tokens); None until prepared
    generator: torch.Generator | None = None  # its sampling stream on the device
    positions: torch.Tensor | None = None
    blocks: torch.Tensor | None = None  # each prompt token's image block (-1: text), for the masks
    block_ids: list[int] = field(default_factory=list)  # the same, for the policy's prefill chunks
    solo: bool = False  # failed in a batch: runs alone so a bad row names itself
    cond: list | None = None  # under pipeline stages, its conditioning images encoded ahead (`_encode_ahead`)
    cond_error: BaseException | None = None  # or why they could not be
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    batch_sum: int = 0  # rows of its decode steps, summed (mean occupancy = batch_sum / steps)

    @property
    def prompt_len(self) -> int:
        return len(self.row.seq.cond_ids)


class _RowWriter:
    """Stands in for the KVCache in `Attention.forward` during one row's prefill chunk: writes the
    chunk's K/V into the row's slot at [start, end) and returns the row's K/V through end."""

    def __init__(self, cache: KVCache, slot: int, start: int) -> None:
        self.cache, self.slot, self.start = cache, slot, start

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.start + k.shape[2]
        layer -= self.cache.first_layer  # a pipeline stage's pool holds its own layers only
        keys = self.cache.k_rows[layer][self.slot:self.slot + 1]
        values = self.cache.v_rows[layer][self.slot:self.slot + 1]
        keys[:, :, self.start:end] = k
        values[:, :, self.start:end] = v
        return keys[:, :, :end], values[:, :, :end]


@dataclass
class SchedulerStats:
    rows: int = 0
    failed: int = 0
    decode_steps: int = 0
    decode_row_steps: int = 0  # rows fed over all decode steps (mean occupancy = / decode_steps)
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0  # wall time of the prefill chunks, the device's work included
    decode_s: float = 0.0  # wall time of the decode steps (choosing tokens, finishing rows, the step)
    finish_s: float = 0.0  # of which finishing rows: the decoded tokens' K/V rewritten, the export
    capture_steps: int = 0  # decode steps that captured a CUDA graph (and compiled) instead of replaying
    capture_s: float = 0.0
    peak_rows: int = 0
    row_groups: int = 1  # groups that decode in turn (one per pipeline stage)
    peak_steps_in_flight: int = 0  # decode steps of different groups in the stages at once
    images_encoded: int | None = None  # under pipeline stages, conditioning images this stage encoded
    oom_retries: int = 0
    pool_rows: int = 0
    pool_capacity: int = 0
    kv_budget_bytes: int | None = None
    outside_allocator_bytes: int | None = None
    events: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mean_batch"] = round(self.decode_row_steps / self.decode_steps, 3) if self.decode_steps else 0.0
        return d


class ARScheduler:
    """Runs requests through `ARGenerator`'s row logic (prepare_row, choice, advance, finish_row)
    with continuous batching (module docstring). The only AR loop."""

    def __init__(self, ar, sampling, admission: Admission, export_kv: bool = True) -> None:
        from .kernels.decode import decode_mode

        self.ar, self.model, self.sampling, self.export_kv = ar, ar.model, sampling, export_kv
        self.prefill_decoded = ar.prefill_decoded_kv
        self.graphs = decode_mode(self.model) == "graphs"
        self.admission = admission
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []
        self.slots: dict[int, _Seq] = {}
        self.pool: KVCache | None = None
        self.decoder: StaticDecoder | None = None
        self.logits: torch.Tensor | None = None
        # row groups [lo, hi) of the pool that decode in turn: under pipeline stages one per stage,
        # so each stage works on one group's step while the next stage works on another's (the
        # kernel setting stage_row_groups=off: one group, each forward through the stages in turn,
        # the schedule before row groups; benchmarks/ar_row_groups_cpu.py compares them)
        settings = kernels.settings()
        self.alone = admission.decodes_alone()
        group_count = 1 if self.model.pipeline is None or self.alone \
            or settings.stage_row_groups == "off" else self.model.pipeline.pp_size
        self.policy = BatchPolicy(admission.max_rows, admission.kv_budget_bytes, kv_bytes_per_token(self.model),
                                  sampling.max_new_tokens + CLOSING_MARGIN, SPAN_STEP, group_count)
        self.groups: list[tuple[int, int]] = []
        # under pipeline stages, forwards whose results come back from the last stage, in the order
        # they started (every stage lands them in that order): ("step", group lo, (step, rows fed))
        # or ("prompt", seq, StageWork) for a row whose last prefill chunk is in the stages
        self.landing: deque[tuple[str, Any, Any]] = deque()
        self.sending: list = []  # hand-offs of forwards nothing waits for (prefill chunks, rewrites)
        self.sampler = DeviceSampler(sampling, ar.tok.ratio_choice_ids, [], ar.banned_ids())
        self.stats = SchedulerStats(kv_budget_bytes=self.policy.kv_budget,
                                    outside_allocator_bytes=admission.outside_allocator_bytes)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, requests: list, on_result: Callable[[Any, Any], None]) -> dict:
        """Every request's AROutput, or the exception that failed it, to on_result(request, result)."""
        self.on_result = on_result
        self.waiting.extend(_Seq(r, i) for i, r in enumerate(requests))
        while self.waiting or self.prefilling or self.running or self.landing:
            try:
                if fault_hook is not None:
                    fault_hook(self)
                self.step()
            except Exception as e:  # noqa: BLE001 - decided below: retry smaller, alone, or fail the row
                from .kernels import RankLost

                if isinstance(e, RankLost):
                    raise
                if self._ranks_apart():
                    if is_out_of_memory(e):  # the step fails; its resume starts from half the batch
                        pool_rows = self.pool.k_rows[0].shape[0] if self.pool is not None else 0
                        self._halve(max(len(self.in_flight), 1), pool_rows or len(self.in_flight))
                        self.stats.events.append(f"{type(e).__name__} inside a forward of a tensor- / "
                                                 "pipeline-parallel step: the step fails")
                    raise
                self._recover(e)
        if self.sending:
            self.model.pipeline.wait_all(self.sending)
        self._release()
        return self.stats.as_dict()

    def _ranks_apart(self) -> bool:
        """Whether other ranks compute this model's forwards too (tensor parallel, pipeline stages).
        A failure inside a forward then cannot be recovered by this rank alone: the others wait in
        the forward's collectives (a later stage for this stage's hand-off), and a rank that retried
        on its own would pair its next forward with their old one. So the step fails instead, the
        pool stops every rank, and a resume runs its rows again. Bad input fails in `prepare_row` on
        every rank alike and stays a row error."""
        parallel = getattr(self.model, "parallel", None)
        return parallel is not None and (parallel.world_size > 1 or parallel.pp_size > 1)

    def step(self) -> None:
        """Admit what fits, then each row group's turn as the policy plans it (one turn without
        pipeline stages): one prefill chunk, then the group's rows choose their next tokens and decode
        one step."""
        for turn in self._admit().turns:
            if turn.chunk is not None:
                self._prefill(turn.chunk)
            self._decode_group(*turn.group)

    @property
    def wavefront(self) -> bool:
        """Whether forwards go through the pipeline stages without waiting (row groups in turn)."""
        return self.policy.group_count > 1

    @property
    def in_flight(self) -> list[_Seq]:
        return sorted(self.prefilling + self.running, key=lambda s: s.order)

    # -- admission --------------------------------------------------------------------------------
    def _admit(self) -> StepPlan:
        """The policy's admission, carried out round by round: the rows it takes (into a slot, or
        failed as too large), then what it asks about the first row still waiting (the gate's
        answer, the row prepared, a pool of its size allocated), until it plans the step's turns."""
        gate_says: bool | None = None  # the gate's answer for the first waiting row
        while True:
            plan = self.policy.plan(self._state(gate_says))
            for admit in plan.admit:
                self._take(admit)
            if plan.admit:
                gate_says = None  # another row is first now
            if plan.ask == GATE:
                gate_says = self.admission.gate(len(self.slots))
            elif plan.ask == PREPARE:
                if not self._prepare(self.waiting[0]):
                    gate_says = None  # it failed and left: the gate is asked for the next one
            elif plan.ask == GROW:
                seq = self.waiting[0]
                error = self._allocate(plan.grow_pool_to)
                if error is not None:  # not even one slot of this row's size fits (on some rank)
                    self.waiting.popleft()
                    self._fail(seq, self._too_large(seq, plan.grow_pool_to, error))
                    gate_says = None
            else:
                if plan.held_idle:  # a gate that does not block: do not spin
                    time.sleep(0.005)
                return plan

    def _state(self, gate_says: bool | None) -> StepState:
        return StepState(self.waiting, self.slots, self.prefilling, self.groups,
                         None if self.pool is None else self.pool.capacity, self.admission.max_num_batched_tokens,
                         self.admission.gate is not None, gate_says)

    def _take(self, admit: Admit) -> None:
        """A waiting row the policy took: it fails as too large, or joins the batch in its slot."""
        seq = self.waiting.popleft()
        assert seq is admit.row, "the policy takes the waiting rows in order"
        if admit.slot is None:
            self._fail(seq, self._too_large(seq, admit.capacity))
        else:
            self._place(seq, admit.slot)

    def _prepare(self, seq: _Seq) -> bool:
        """The row's prompt (images encoded), or its failure: a bad input fails the row."""
        try:
            if self.wavefront and seq.cond is None:
                self._encode_ahead()
            if seq.cond_error is not None:
                raise seq.cond_error
            seq.row = self.ar.prepare_row(seq.request, seq.cond)
        except Exception as e:  # noqa: BLE001
            if is_out_of_memory(e):
                raise
            self.waiting.popleft()
            self._fail(seq, e)
            return False
        seq.row.offset = 0
        seq.need = self.policy.need(seq.prompt_len)
        seq.positions = seq.row.seq.positions()
        seq.blocks = seq.row.seq.block_ids()
        seq.block_ids = seq.blocks.tolist()
        seq.generator = self.ar.sampling_generator(seq.row)
        return True

    def _encode_ahead(self) -> None:
        """Under pipeline stages, the conditioning images of the next waiting rows, one row a stage
        at once. Only stage 0 embeds them (the later stages receive hidden states), so stage k
        encodes the k-th row and hands its latents and ViT tokens to stage 0; every stage fits every
        image on the host, which gives the footprints the row's sequence needs. Without this each
        stage encoded every image, all at the same point of the loop."""
        pp, ar, model = self.model.pipeline, self.ar, self.model
        batch = []
        for seq in self.waiting:
            if len(batch) == pp.pp_size:
                break
            if seq.cond is not None or seq.row is not None:
                continue
            try:
                fitted = fit_cond_images(model, ar.builder, seq.request.images, seq.request.infer_align_image_size)
            except Exception as e:  # noqa: BLE001 - a bad image fails its row, on every stage alike
                seq.cond, seq.cond_error = [], e
                continue
            seq.cond = [EncodedImage(f.footprint, None, None) for f in fitted]
            if fitted:
                batch.append((seq, fitted))
        for k, (seq, fitted) in enumerate(batch):
            if k == pp.pp_rank:
                seq.cond = encode_fitted(model, fitted, ar.cond_generator(seq.request))
                self.stats.images_encoded = (self.stats.images_encoded or 0) + len(fitted)
        for k, (seq, _) in enumerate(batch[1:], start=1):  # to stage 0, in row order on every stage
            for i, image in enumerate(seq.cond):
                if pp.pp_rank == k:
                    pp.send_stage(image.latents, 0)
                    pp.send_stage(image.vit_tokens, 0)
                    seq.cond[i] = EncodedImage(image.footprint, None, None)  # stage k embeds nothing
                elif pp.pp_rank == 0:
                    seq.cond[i] = EncodedImage(image.footprint, pp.recv_any_stage(k), pp.recv_any_stage(k))

    def _allocate(self, capacity: int) -> BaseException | None:
        """A fresh pool of as many slots as fit (and as rows are left), `capacity` tokens each. Out
        of memory (on any rank: they agree), the row cap and budget halve and it tries again; the
        error when even one slot does not fit (the pool is None then), else None."""
        while True:
            self._release()
            left = len(self.waiting) + len(self.slots)
            rows = self.policy.pool_rows(capacity, left)
            error: BaseException | None = None
            try:
                if allocation_fault_hook is not None:
                    allocation_fault_hook(self, rows)
                self._new_pool(rows, capacity)
            except Exception as e:  # noqa: BLE001 - out of memory is decided below, the rest raises
                if not is_out_of_memory(e):
                    raise
                error = e
            if self._ranks_apart():  # every rank allocates alike: all go on, or all halve
                if self.model.parallel.agree_max([int(error is not None)])[0] and error is None:
                    error = torch.OutOfMemoryError("another rank ran out of memory allocating its K/V pool")
            if error is None:
                return None
            self._release()
            self.stats.events.append(f"{type(error).__name__} allocating a K/V pool of {rows} row(s)")
            if self.policy.after_failure(rows, rows, out_of_memory=True, solo=False) == "fail":
                return error  # a pool of one slot: this row does not fit alone
            self.stats.oom_retries += 1
            self._halve(rows, rows)

    def _new_pool(self, rows: int, capacity: int) -> None:
        self.pool = self.model.new_cache(rows, capacity)
        self.decoder = StaticDecoder(self.model, self.pool, torch.zeros(rows, capacity, dtype=torch.bool), [0] * rows,
                                     self.ar.tok.pad, self.graphs)
        self.logits = torch.zeros(rows, self.model.config.vocab_size, device=self.model.device)
        self.stats.pool_rows, self.stats.pool_capacity = rows, capacity
        self.groups = self.policy.groups(rows)
        self.stats.row_groups = len(self.groups)

    def _place(self, seq: _Seq, slot: int) -> None:
        seq.slot, seq.length = slot, 0
        self.slots[slot] = seq
        self.decoder.valid[slot] = False
        self.prefilling.append(seq)
        self.stats.peak_rows = max(self.stats.peak_rows, len(self.slots))

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill(self, chunk: Chunk) -> None:
        """One chunk of the oldest prefilling row; a row whose prompt is complete starts decoding
        (under pipeline stages once its last chunk's result has come back: `_land`)."""
        seq, end = chunk.row, chunk.end
        assert seq is self.prefilling[0] and seq.length == chunk.start, "the plan's chunks follow the prompts"
        t0 = time.perf_counter()
        ids = seq.row.seq.cond_ids
        x = None
        if self.model.pipeline is None or self.model.pipeline.pp_rank == 0:  # later stages receive theirs
            x = embed_span(self.model, ids, seq.row.seq, seq.length, end, seq.row.cond).unsqueeze(0)
        complete = end == len(ids)
        last = self._forward_row(seq, x, seq.positions[seq.length:end], seq.blocks[:end], back=complete)
        self.decoder.valid[seq.slot, seq.length:end] = True
        self.stats.prefill_chunks += 1
        self.stats.prefill_tokens += end - seq.length
        seq.length = end
        if complete:
            self.prefilling.pop(0)
            if self.wavefront:
                self.landing.append(("prompt", seq, last))
            else:
                self._prompt_done(seq, last)
        if not self.wavefront:
            _wait_for_device(self.model.device)  # so the chunk's time is its own, not the next decode step's
        dt = time.perf_counter() - t0
        seq.prefill_s += dt
        self.stats.prefill_s += dt

    def _prompt_done(self, seq: _Seq, last: torch.Tensor) -> None:
        """The row's first logits from its prompt's last hidden state [1, hidden]: it decodes from now."""
        self.logits[seq.slot] = self.model.text_logits(last)[0]
        self.running.append(seq)

    def _forward_row(self, seq: _Seq, x: torch.Tensor | None, positions: torch.Tensor, k_blocks: torch.Tensor,
                     back: bool = True):
        """Tokens [start, end) of one row (x [1, T, H]; None on a later pipeline stage) through the
        layers over its cached prefix; writes their K/V into its slot. The last token's hidden
        state [1, hidden]; under pipeline stages (the wavefront), the StageWork that lands it (with
        `back`), the forward going on in the later stages meanwhile. A stage needs only its own
        layers' K/V of the earlier chunks, so a row's chunks follow each other without waiting."""
        start = seq.length
        end = start + len(positions)
        slots = torch.arange(end)
        mask = SlotMask(slots[start:].unsqueeze(0), slots.unsqueeze(0), k_blocks[start:end].unsqueeze(0),
                        k_blocks.unsqueeze(0)).to(self.model.device)
        positions = positions.unsqueeze(0).to(self.model.device)
        writer = _RowWriter(self.pool, seq.slot, start)
        model = self.model
        compiled = kernels.prefill_compiled()
        if not self.wavefront:
            return model.forward_layers(x, positions, mask, writer, compiled=compiled, prefill=True)[:, -1]
        work = model.stages.start(x, lambda h: model.forward_layers(h, positions, mask, writer, compiled=compiled,
                                                                    layers=model.stage_layers, prefill=True), back)
        if not back:
            self.sending = [w for w in self.sending if not w.is_completed()]
            self.sending.extend(work.sends)
        return work

    # -- decode -----------------------------------------------------------------------------------
    def _decode_group(self, lo: int, hi: int) -> None:
        """The group's step in flight lands, its rows choose their next tokens, finished rows leave,
        and one decode step starts for the rest. Without pipeline stages (one group) the step
        lands at once."""
        t0 = time.perf_counter()
        self._land(lo)
        rows = [s for s in self.running if lo <= s.slot < hi]
        if not rows:
            return
        ar, sampling = self.ar, self.sampling
        hows = {s.slot: (None if s.row.done else ar.choice(s.row, sampling)) for s in rows}
        top = max(hows) + 1
        picked: dict[int, Any] = {}
        if any(h in ("ratio", "sample") for h in hows.values()):
            sample_rows = [hows.get(i) == "sample" for i in range(lo, top)]
            gens = [self.slots[i].generator if sample_rows[i - lo] else None for i in range(lo, top)]
            picked = dict(zip(range(lo, top), self.sampler(self.logits[lo:top], sample_rows, gens)))
        feed: dict[int, int] = {}
        for seq in rows:
            token = ar.advance(seq.row, sampling, picked.get(seq.slot), hows[seq.slot])
            if token is None:
                self._finish(seq)
            else:
                feed[seq.slot] = token
        if not feed:
            return
        graphs = len(self.decoder.graphs)
        self._step(feed, lo, hi)
        if not self.wavefront:  # one group: its step lands now (with row groups, on the group's next turn)
            self._land(lo)
            _wait_for_device(self.model.device)
        dt = time.perf_counter() - t0
        self.stats.decode_s += dt
        if len(self.decoder.graphs) > graphs:
            self.stats.capture_steps += 1
            self.stats.capture_s += dt
        self.stats.decode_steps += 1
        self.stats.decode_row_steps += len(feed)
        shared = 1 if self.alone else len(feed)  # rows of each row's step
        for slot in feed:
            seq = self.slots[slot]
            seq.steps += 1
            seq.batch_sum += shared
            seq.decode_s += dt / len(feed)

    def _step(self, feed: dict[int, int], lo: int, hi: int) -> None:
        """Start one decode step of the group of rows [lo, hi): each fed row writes its token's K/V
        at its next slot; the logits land with `_land`."""
        if self.alone:  # every row alone: its numbers see no other row
            for slot, token in feed.items():
                self.logits[slot] = self.decoder.step([token], [self.slots[slot].length], lo=slot)[0]
                self.slots[slot].length += 1
            return
        top = max(s for s in self.slots if s < hi) + 1
        tokens = [feed.get(i) for i in range(lo, top)]
        # rows that feed nothing write a masked pad where their next prefill chunk writes anyway
        slots = [self.slots[i].length if i in self.slots else 0 for i in range(lo, top)]
        self.landing.append(("step", lo, (self.decoder.start(tokens, slots, lo, hi), list(feed))))
        steps = sum(kind == "step" for kind, _, _ in self.landing)
        self.stats.peak_steps_in_flight = max(self.stats.peak_steps_in_flight, steps)
        for slot in feed:
            self.slots[slot].length += 1

    def _land(self, lo: int) -> None:
        """What has come back for group `lo`, in the order it started: every prompt that completed
        before its step in flight, then that step (the logits of its fed rows; the other rows keep
        theirs: a row whose prefill just ended has its own). Without a step of the group in flight,
        the prompts at the front. Another group's step stops it (it lands on that group's turn)."""
        while self.landing:
            kind, key, work = self.landing[0]
            if kind == "step" and key != lo:
                return
            self.landing.popleft()
            if kind == "prompt":
                self._prompt_done(key, self.model.stages.land(work))
                continue
            step, fed = work
            logits = self.decoder.land(step)
            index = torch.tensor(fed, device=logits.device)
            self.logits[index] = logits[index - lo]
            return

    # -- leaving ----------------------------------------------------------------------------------
    def _finish(self, seq: _Seq) -> None:
        """Export the row's K/V and hand its output over; its slot is free for a waiting row."""
        row = seq.row
        t0 = time.perf_counter()
        if self.export_kv and self.prefill_decoded and row.generated[:-1]:
            self._write_decoded(seq)
        out = self.ar.finish_row(row, seq.slot, self.pool if self.export_kv else None)
        self.stats.finish_s += time.perf_counter() - t0
        out.timings = {"ar_prefill_s": seq.prefill_s, "ar_decode_s": seq.decode_s,
                       "ar_batch_size": round(seq.batch_sum / seq.steps, 3) if seq.steps else 1,
                       "ar_decode_steps": seq.steps, "prompt_tokens": seq.prompt_len,
                       "generated_tokens": len(row.generated)}
        self._leave(seq)
        self.stats.rows += 1
        self.on_result(seq.request, out)

    def _write_decoded(self, seq: _Seq) -> None:
        """The decoded tokens' K/V written again by one prefill chunk over the prompt, so the exported
        K/V come from the prefill kernels, as the DiT's recompute (ar.PREFILL_DECODED_KV). The decode
        step's attention kernel is not the prefill's, so its K/V differ from the recompute's in the
        last bf16 bits, and the difference grows through the denoising. Costs one prefill of the
        CoT length per row; tokens already chosen are not touched."""
        fed = seq.row.generated[:-1]
        start, n = seq.prompt_len, len(fed)
        if seq.length != start + n:
            raise RuntimeError(f"row {seq.request.id}: decode wrote {seq.length - start} slots, it fed {n} tokens")
        seq.length = start
        ids = torch.tensor([fed], dtype=torch.long, device=self.model.device)
        positions = torch.arange(start, start + n, dtype=torch.float64).unsqueeze(1).expand(n, 2)
        blocks = torch.full((start + n,), -1, dtype=torch.long)
        self._forward_row(seq, self.model.embed_ids(ids), positions, blocks, back=False)
        seq.length = start + n

    def _leave(self, seq: _Seq) -> None:
        for queue in (self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
        self.slots.pop(seq.slot, None)
        seq.slot = -1

    def _fail(self, seq: _Seq, error: BaseException) -> None:
        self.stats.failed += 1
        self.on_result(seq.request, error)

    # -- out of memory and other failures ---------------------------------------------------------
    def _recover(self, error: Exception) -> None:
        """Drop the failed attempt's memory and put its rows back: on OOM with a smaller row cap,
        else each alone (so the row that fails names itself). A row alone fails for good."""
        rows = self.in_flight
        if not rows and self.waiting:
            rows = [self.waiting.popleft()]  # failed while being prepared or placed, alone
        for seq in rows:
            self._leave(seq)
            seq.row, seq.need, seq.length = None, None, 0  # prepared again (same prompt, same seed)
            seq.prefill_s, seq.decode_s, seq.steps, seq.batch_sum = 0.0, 0.0, 0, 0
        pool_rows = self.pool.k_rows[0].shape[0] if self.pool is not None else 0
        self._release()
        oom = is_out_of_memory(error)
        self.stats.events.append(f"{type(error).__name__} with {len(rows)} row(s) in flight")
        action = self.policy.after_failure(len(rows), pool_rows, oom, bool(rows) and rows[0].solo)
        if action == "fail":
            seq = rows[0]
            if oom and not isinstance(error, RowTooLarge):
                error = self._too_large(seq, None, error)
            self._fail(seq, error)
            return
        if action == "halve":
            self.stats.oom_retries += 1
            self._halve(len(rows), pool_rows)
        else:
            for seq in rows:
                seq.solo = True
        self.waiting.extendleft(reversed(rows))

    def _halve(self, rows_in_flight: int, pool_rows: int) -> None:
        """After an OOM: half the rows that were in flight, half the K/V budget (kept in the admission,
        so the AR step can hand them to a resume, unless neither got smaller: one row, no budget)."""
        kept = self.policy.halve(rows_in_flight, pool_rows)
        if kept is not None:
            self.admission.halved_to = kept

    def _too_large(self, seq: _Seq, capacity: int | None, error: BaseException | None = None) -> RowTooLarge:
        req = seq.request
        prompt = len(seq.row.seq.cond_ids) if seq.row is not None else None
        gib = 1 << 30
        size = (f"{prompt} prompt tokens + {self.policy.budget_tokens} CoT budget -> "
                f"{self.policy.row_bytes(self.policy.need(prompt)) / gib:.2f} GiB of K/V on this rank"
                if prompt is not None else "its prompt could not even be prepared")
        if error is not None:
            where = f"it ran out of GPU memory alone ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        else:
            budget = self.policy.kv_budget or 0
            where = (f"the K/V budget is {budget / gib:.2f} GiB (--gpu-memory-utilization "
                     f"{self.admission.gpu_memory_utilization} of the GPU, less the weights and activations)")
        return RowTooLarge(f"row {req.id} does not fit alone: {size}; {where}. To fit it: split the model over more "
                           "GPUs (--tp 2 splits the K/V heads, --pp 2 the layers), --quantization fp8 (frees weight "
                           "memory), a higher --gpu-memory-utilization or a smaller --max-new-tokens")

    def _release(self) -> None:
        """Free the pool, the decode graphs and the allocator's cached blocks."""
        self.pool = self.decoder = self.logits = None
        self.landing.clear()
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

