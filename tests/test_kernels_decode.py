"""The static-shape AR decode step and device sampling (kernels/decode.py) against the plain path,
on the CPU (tiny config, fp32): the static step runs eagerly here; CUDA graphs replay the same
function and are compared with it in benchmarks/decode_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from components.engine import ARRequest, SamplingParams, kernels
from components.engine.ar import ARGenerator
from components.engine.kernels import decode
from components.engine.kernels.decode import DecodeMask, DeviceSampler, StaticDecoder, batch_bucket, decode_mode
from components.engine.transformer import KVCache, attention_mask

from .test_engine_helpers import keep_cot_in_tokenizer, random_image, tiny_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=12)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture
def static_decode():
    previous = kernels.configure(decode_graphs="on")  # on the CPU: the static step, eagerly
    yield
    kernels.configure(previous)


def _requests():
    """Left padding (prompts of different lengths) and rows that stop at different steps."""
    return [
        ARRequest("short", "a cat", [], bot_task="think_recaption", seed=11),
        ARRequest("long", "a watercolor painting of a golden horse near a river at sunset, soft light", [],
                  bot_task="think_recaption", seed=12),
        ARRequest("edit", "make the sky purple", [random_image(160, 96, seed=1)], bot_task="think", seed=13),
        ARRequest("img", "a dog", [], bot_task="image"),  # one ratio token: done after the first step
        ARRequest("txt", "hello", [], bot_task="auto", seed=14),
    ]


# --------------------------------------------------------------------------- selection
def test_decode_mode_and_buckets(engine, static_decode):
    assert decode_mode(engine.model) == "eager"  # graphs need CUDA
    kernels.configure(decode_graphs="auto")
    assert decode_mode(engine.model) == "plain"  # auto: plain on the CPU
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 64, 64, 128]


def test_decode_mode_under_stages_and_tensor_parallel(engine, static_decode, monkeypatch):
    """As on a GPU (`auto` choosing the fast paths): a pipeline stage takes the static step (CUDA
    graphs on CUDA bf16 weights; "eager" for these CPU ones) as one GPU does, and `off` the plain
    step. Tensor-parallel ranks take the static step too, but not under stages as well."""
    monkeypatch.setattr(kernels, "fast_device", lambda t: True)
    engine.model.parallel = type("Ctx", (), {"world_size": 1, "pp_size": 2})()
    try:
        kernels.configure(decode_graphs="auto")
        assert decode_mode(engine.model) == "eager"
        kernels.configure(decode_graphs="off")
        assert decode_mode(engine.model) == "plain"
        engine.model.parallel.world_size, engine.model.parallel.pp_size = 2, 1
        kernels.configure(decode_graphs="auto")
        assert decode_mode(engine.model) == "eager"
        kernels.configure(decode_graphs="off")
        assert decode_mode(engine.model) == "plain"
        kernels.configure(decode_graphs="on")
        engine.model.parallel.pp_size = 2
        assert decode_mode(engine.model) == "plain"
    finally:
        del engine.model.parallel


def test_kv_cache_spare_rows_keep_its_public_view():
    plain = KVCache(2, 3, 2, 4, 10, torch.float32, "cpu")
    assert plain.k is plain.k_rows and plain.k[0].shape == (3, 2, 10, 4)
    padded = KVCache(2, 3, 2, 4, 10, torch.float32, "cpu", rows=4)
    assert padded.k[0].shape == (3, 2, 10, 4) and padded.k_rows[0].shape == (4, 2, 10, 4)
    padded.update(0, torch.ones(3, 2, 2, 4), torch.ones(3, 2, 2, 4))
    padded.commit()
    assert padded.length == 2 and padded.k_rows[0][:3, :, :2].eq(1).all() and padded.k_rows[0][3].eq(0).all()


# --------------------------------------------------------------------------- the step itself
def _prefill(model, lengths: list[int], capacity: int, rows: int | None):
    """Left-padded random-token prefill; (cache, last logits, valid, offsets)."""
    gen = torch.Generator().manual_seed(0)
    length = max(lengths)
    batch = len(lengths)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)
    valid = torch.zeros(batch, capacity, dtype=torch.bool)
    positions = torch.zeros(batch, length, 2, dtype=torch.float64)
    offsets = [length - n for n in lengths]
    for b, off in enumerate(offsets):
        valid[b, off:length] = True
        positions[b, off:] = torch.arange(length - off, dtype=torch.float64)[:, None]
    slots = torch.arange(length).expand(batch, length)
    blocks = torch.full((batch, length), -1)
    mask = attention_mask(slots, slots, blocks, blocks, valid[:, :length])
    cache = model.new_cache(batch, capacity, rows)
    hidden = model.forward_layers(model.embed_ids(ids), positions, mask, cache)
    cache.commit()
    return cache, model.text_logits(hidden[:, -1]), valid, offsets


def _plain_step(model, cache, valid, offsets, tokens, pad):
    """One plain decode step, as the removed static batch loop (ARGenerator._decode) wrote it: the
    reference the static step is checked against."""
    slot = cache.length
    feed = torch.tensor([[t if t is not None else pad] for t in tokens])
    for b, t in enumerate(tokens):
        valid[b, slot] = t is not None
    positions = torch.tensor([[[slot - off] * 2] for off in offsets], dtype=torch.float64)
    k_slots = torch.arange(slot + 1).expand(len(tokens), slot + 1)
    q_slots = torch.full((len(tokens), 1), slot)
    no_block = torch.full((len(tokens), slot + 1), -1)
    mask = attention_mask(q_slots, k_slots, no_block[:, :1], no_block, valid[:, :slot + 1])
    hidden = model.forward_layers(model.embed_ids(feed), positions, mask, cache)
    cache.commit()
    return model.text_logits(hidden[:, -1])


@pytest.mark.parametrize("grouped", [False, True])
@torch.no_grad()
def test_static_step_logits_match_the_plain_step(engine, monkeypatch, grouped):
    """Left padding, a row that finishes (feeds masked pads), padded bucket rows, and spans that
    grow mid-decode (SPAN_STEP 8): logits within 1e-5 of the plain step at every step."""
    monkeypatch.setattr(decode, "SPAN_STEP", 8)
    monkeypatch.setattr(decode, "GROUPED_FROM", 0 if grouped else 10**9)
    model = engine.model
    lengths, capacity, pad = [5, 9, 3], 20, 0
    cache_p, logits_p, valid_p, offsets = _prefill(model, lengths, capacity, None)
    cache_s, logits_s, valid_s, _ = _prefill(model, lengths, capacity, batch_bucket(3))
    assert torch.equal(logits_p, logits_s)
    decoder = StaticDecoder(model, cache_s, valid_s, offsets, pad, graphs=False)
    assert decoder.rows == 4
    spans = set()
    for step in range(8):
        tokens = [int(logits_p[b].argmax()) for b in range(3)]
        if step >= 2:
            tokens[2] = None  # finished: masked pads from here on
        spans.add(decoder.span(cache_s.length))
        logits_p = _plain_step(model, cache_p, valid_p, offsets, tokens, pad)
        logits_s = decoder.step(tokens)
        assert cache_s.length == cache_p.length
        live = [b for b in range(3) if tokens[b] is not None]
        assert (logits_s[live] - logits_p[live]).abs().max().item() <= 1e-5, step
        assert torch.isfinite(logits_s).all()
    assert spans == {16, 20}  # a span bucket, then the whole capacity
    for layer in range(len(cache_p.k)):  # the K/V written are the plain step's, for every real row
        assert (cache_s.k[layer][:, :, :cache_p.length] - cache_p.k[layer][:, :, :cache_p.length]).abs().max() <= 1e-5


@torch.no_grad()
def test_negative_control_visible_left_padding_changes_the_logits(engine):
    """The comparison above can fail: letting row 0 see its left padding moves its logits."""
    model = engine.model
    cache, logits, valid, offsets = _prefill(model, [5, 9], 16, 2)
    tokens = [int(logits[b].argmax()) for b in range(2)]
    good = StaticDecoder(model, cache, valid, offsets, 0, graphs=False)
    ref = good.step(tokens).clone()
    cache.length -= 1
    bad = StaticDecoder(model, cache, valid, offsets, 0, graphs=False)
    bad.valid[0, :offsets[0]] = True
    wrong = bad.step(tokens)
    assert (wrong[0] - ref[0]).abs().max().item() > 1e-3
    assert (wrong[1] - ref[1]).abs().max().item() <= 1e-6  # row 1 has no padding: unchanged


def test_grouped_attention_equals_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    keep = torch.rand(3, 1, 1, 40) > 0.3
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    old = decode.GROUPED_FROM
    try:
        decode.GROUPED_FROM = 0
        assert (DecodeMask(keep).attend(q, k, v) - ref).abs().max() <= 1e-6
    finally:
        decode.GROUPED_FROM = old


# --------------------------------------------------------------------------- the AR end to end
# (The static step's logits equal the plain step's: test_static_step_logits_match_the_plain_step;
# the device sampler picks HF's tokens: test_device_sampler_picks_what_hf_sampling_picks. The AR has
# one loop, the scheduler, which runs the static step on every device.)
def test_forced_tokens_mid_cot_consume_no_draw(engine, monkeypatch):
    """A stage transition in the middle of sampling (here: the row's first sampled token forces two
    tokens): the forced steps draw nothing from the row's stream; only its sampled tokens do."""
    first = engine.generate_ar([_requests()[1]], SAMPLED)[0].generated_ids[0]
    real_prepare, real_advance, real_sampler = ARGenerator.prepare_row, ARGenerator.advance, DeviceSampler.__call__
    hows, draws = [], []

    def prepare(self, req, cond=None):
        row = real_prepare(self, req, cond)
        row.transitions[first] = self.tok.encode("a b")
        return row

    def advance(self, row, sampling, picked, how=None):
        hows.append(how if how is not None else self.choice(row, sampling))
        return real_advance(self, row, sampling, picked, how)

    def sampler(self, logits, sample_rows, generators=None):
        draws.append(sum(sample_rows))
        return real_sampler(self, logits, sample_rows, generators)

    monkeypatch.setattr(ARGenerator, "prepare_row", prepare)
    monkeypatch.setattr(ARGenerator, "advance", advance)
    monkeypatch.setattr(DeviceSampler, "__call__", sampler)
    out = engine.generate_ar([_requests()[1]], SAMPLED)[0]
    assert out.generated_ids[:3] == [first] + engine.ar.tok.encode("a b")  # the forced tokens, mid-CoT
    assert hows[:3] == ["sample", "pending", "pending"] and len(out.generated_ids) > 4
    assert sum(draws) == hows.count("sample")  # a draw for each sampled token, none for the forced


def test_static_sampled_rows_are_reproducible_and_batch_independent(engine, static_decode):
    reqs = _requests()
    a = engine.generate_ar(reqs, SAMPLED)
    b = engine.generate_ar(reqs, SAMPLED)
    single = engine.generate_ar([reqs[1]], SAMPLED)[0]
    assert [o.generated_ids for o in a] == [o.generated_ids for o in b]
    assert single.generated_ids == a[1].generated_ids


# --------------------------------------------------------------------------- sampling
def _logits(batch=4, vocab=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3


def _hf_warped(logits, sp: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float().clone()
    scores = TemperatureLogitsWarper(sp.temperature)(None, scores)
    scores = TopKLogitsWarper(sp.top_k)(None, scores)
    return TopPLogitsWarper(sp.top_p)(None, scores)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
                                SamplingParams(temperature=1.3, top_k=5, top_p=0.5),
                                SamplingParams(temperature=0.5, top_k=1000, top_p=0.99)])
def test_device_warp_has_hf_semantics(sp):
    logits = _logits()
    ours = DeviceSampler(sp, [0], []).warp(logits)
    hf = _hf_warped(logits, sp)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))  # the same support set
    assert torch.equal(ours, hf)  # and the same scores on it
    kept = (~torch.isinf(ours)).sum(-1)
    assert (kept >= 1).all() and (kept <= sp.top_k).all()


def test_negative_control_warp_without_top_p_differs():
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    logits = _logits()
    no_top_p = SamplingParams(temperature=0.8, top_k=50, top_p=1.0)
    assert not torch.equal(torch.isinf(DeviceSampler(no_top_p, [0], []).warp(logits)),
                           torch.isinf(_hf_warped(logits, sp)))


def _hf_sample(logits: torch.Tensor, sp: SamplingParams, generator: torch.Generator) -> int:
    """HF `generate`'s choice of one token: greedy argmax, else warped scores then multinomial."""
    if sp.greedy:
        return int(logits.float().argmax())
    probs = torch.softmax(_hf_warped(logits.float()[None], sp)[0], dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def test_device_sampler_picks_what_hf_sampling_picks(engine):
    """Same logits, generators seeded alike: greedy and sampled tokens equal HF sampling's
    (torch.multinomial's one-sample draw is argmax(p / q), q ~ Exp(1), from the same stream). Rows
    that do not sample leave their generator untouched."""
    ar: ARGenerator = engine.ar
    vocab = ar.tok.vocab_size
    logits = _logits(batch=6, vocab=vocab + 24)
    ratio_ids = ar.tok.ratio_choice_ids
    for sp in (GREEDY, SAMPLED):
        sp = sp.resolved(ar.generation_config)
        for trial in range(5):
            gens = [torch.Generator().manual_seed(100 * trial + b) for b in range(6)]
            sample_rows = [True, True, False, True, True, False]
            states = [g.get_state() for g in gens]
            picked = DeviceSampler(sp, ratio_ids, gens)(logits, sample_rows)
            for b in range(6):
                if not sample_rows[b]:
                    assert torch.equal(gens[b].get_state(), states[b])
                    continue
                g = torch.Generator().manual_seed(100 * trial + b)
                assert picked[b][1] == _hf_sample(logits[b], sp, g)
                assert picked[b][0] == ratio_ids[int(logits[b, ratio_ids].argmax())]


def test_negative_control_another_stream_picks_other_tokens():
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    logits = torch.zeros(64, 1024)  # uniform: every draw is a fresh token
    a = DeviceSampler(sp, [0], [torch.Generator().manual_seed(b) for b in range(64)])(logits, [True] * 64)
    b = DeviceSampler(sp, [0], [torch.Generator().manual_seed(b + 1000) for b in range(64)])(logits, [True] * 64)
    assert sum(x[1] != y[1] for x, y in zip(a, b)) > 50


# --------------------------------------------------------------------------- exported K/V
@pytest.mark.parametrize("prefilled", [True, False], ids=["prefilled", "as-decoded"])
def test_decoded_tokens_kv_is_written_again_by_a_prefill(prefilled, monkeypatch):
    """After a static-step decode, the decoded tokens' K/V are written again by one prefill chunk
    (ar.PREFILL_DECODED_KV), so the exported K/V equal the DiT's recompute of the same tokens bit
    for bit (bf16, CPU). As decoded (the negative control) they differ: the decode step's attention
    is not the prefill's kernel."""
    from components.engine import Engine
    from components.engine import ar as ar_module
    from components.engine.inputs import request_generator
    from components.engine.sequence import first_difference

    monkeypatch.setattr(ar_module, "PREFILL_DECODED_KV", prefilled)
    # flex prefills (eager on the CPU) as on the GPU: the decode step's attention is another kernel
    previous = kernels.configure(decode_graphs="on", attention="flex")
    try:
        engine = Engine.load("tiny", dtype="bfloat16")
        keep_cot_in_tokenizer(engine, monkeypatch)  # so decoded tokens stay in the reused prefix
        # a row whose re-encoded CoT keeps decoded tokens in the reused prefix (not every row does)
        image = Image.fromarray((np.random.RandomState(0).rand(192, 256, 3) * 255).astype("uint8"))
        out = engine.generate_ar([ARRequest("e", "make the sky purple", [image], bot_task="think_recaption")],
                                 SamplingParams(temperature=0, max_new_tokens=24))[0]
    finally:
        kernels.configure(previous)
    seq = out.dit_sequence(engine.dit.builder)
    kv = out.prompt_kv
    reused = min(kv.pos_reuse_len, first_difference(out.fed_ids, seq.cond_ids))
    prompt = len(out.prompt_ids)
    assert reused > prompt  # decoded tokens are part of the reused prefix
    previous = kernels.configure(attention="flex")
    try:
        with torch.no_grad():
            cache = engine.dit.prefix_from_scratch(seq, [image], cfg_on=False,
                                                   generator=request_generator(engine.model, out.seed))
    finally:
        kernels.configure(previous)
    same = all(torch.equal(mine[prompt:reused], theirs[0, :, prompt:reused].transpose(0, 1))
               for mine, theirs in zip(kv.keys + kv.values, cache.k + cache.v))
    assert same == prefilled


@torch.no_grad()
def test_compiled_static_step_matches_and_one_graph_serves_every_batch(engine, monkeypatch):
    """compile=on (aot_eager: dynamo's graphs and guards, no C++ build): the static step runs its
    layers through the compiled regions, dynamic in the batch; its logits are the eager step's at
    batches 2, 4 and 8, and batch 8 compiles nothing new (on the CPU the per-expert loop's graph
    breaks may still recompile once at the second batch; static graphs would compile every batch)."""
    from torch._dynamo.utils import counters

    from components.engine.kernels import compiled_layers
    from components.engine.transformer import MoE

    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    monkeypatch.setattr(MoE, "impl", "loop")  # grouped GEMMs have no float32 fake kernel on the CPU
    compiled_layers.reset()
    previous = kernels.configure(compile="on")
    try:
        model, frames = engine.model, []
        for lengths in ([5, 9], [5, 9, 3, 7], [4, 6, 8, 2, 9, 3, 5, 7]):
            rows = batch_bucket(len(lengths))
            cache_c, logits, valid_c, offsets = _prefill(model, lengths, 20, rows)
            cache_e, _, valid_e, _ = _prefill(model, lengths, 20, rows)
            compiled = StaticDecoder(model, cache_c, valid_c, offsets, 0, graphs=False)
            eager = StaticDecoder(model, cache_e, valid_e, offsets, 0, graphs=False)
            eager.compiled = False
            assert compiled.compiled
            for _ in range(3):
                tokens = [int(t) for t in logits.argmax(-1)]
                logits = eager.step(tokens)
                assert (compiled.step(tokens) - logits).abs().max().item() <= 1e-5
            frames.append(counters["frames"]["total"])
        assert frames[0] > 0
        assert frames[2] == frames[1]  # batch 8 ran the graphs of the batches before
    finally:
        kernels.configure(previous)
        compiled_layers.reset()
