"""FP8 weights (`--quantization fp8`): the numbers, which modules, memory, checkpoints, end to end.

Everything here runs the reference path (dequantize, multiply in fp32), which computes the same
numbers as the fused CUDA path (`torch._scaled_mm` / `torch._scaled_grouped_mm`); the GPU benchmark
`benchmarks/fp8_moe.py` checks the fused path against this reference.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import components.engine.quant as quant
from components.engine.config import get_config
from components.engine.engine import build_model_fp8
from components.engine.quant import (
    FP8,
    Fp8Experts,
    Fp8Linear,
    dequantize,
    fp8_linear_reference,
    fp8_moe_reference,
    fp8_modules,
    is_fp8_checkpoint,
    quantize_model_fp8_,
    quantize_rowwise,
    save_pretrained_fp8,
    weight_bytes,
)
from components.engine.transformer import Experts, HunyuanImage3ForCausalMM, MoE
from components.engine.weights import init_dummy_weights, save_pretrained

from . import parallel_targets
from .test_engine_helpers import keep_cot_in_tokenizer, psnr, tiny_engine


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k]))
                                          for k in sa)


@pytest.fixture(scope="module")
def tiny_plain():
    torch.manual_seed(0)
    model = HunyuanImage3ForCausalMM(get_config("tiny"))
    init_dummy_weights(model, seed=0)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_fp8(tiny_plain):
    model = copy.deepcopy(tiny_plain)
    quantize_model_fp8_(model)
    return model


# -- the numbers ----------------------------------------------------------------------------------
def test_quantize_rowwise_scale_rounding_and_saturation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0, 0.0]).unsqueeze(1)
    x[4, 7] = 1e3  # one outlier sets its row's scale
    q, s = quantize_rowwise(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (6,)
    assert torch.equal(s[:5], x[:5].abs().amax(1) / 448)
    assert (q[:5].float().abs().amax(1) == 448).all()  # every row's largest value lands on +-448
    assert torch.equal(q[5].float(), torch.zeros(256)) and torch.isfinite(s).all()  # zero row: zeros, no NaN
    err = (dequantize(q, s) - x).abs()
    # E4M3 has 3 mantissa bits: normal values round to within 2^-4 relative, subnormals to 2^-10 * scale
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.unsqueeze(1) * 2.0 ** -10) * (1 + 1e-6)
    assert (err <= bound).all()
    rel = (err / x.abs().clamp_min(1e-30))[:4]
    assert rel.max() > 2.0 ** -5  # really 8-bit, not a wider type that would round far finer


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch._scaled_mm missing")
def test_reference_linear_matches_torch_scaled_mm_on_cpu():
    """The scale convention of the reference path is torch's: compare with `torch._scaled_mm` where
    the CPU build has it (torch >= 2.9), an independent implementation of the same product."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1
    qw, sw = quantize_rowwise(w)
    qx, sx = quantize_rowwise(x)
    try:
        ours = torch._scaled_mm(qx, qw.t(), scale_a=sx.unsqueeze(1), scale_b=sw.unsqueeze(0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"torch._scaled_mm on CPU: {e}")
    ref = fp8_linear_reference(x, qw, sw)
    assert _rel(ref, ours) < 1e-6
    assert _rel(fp8_linear_reference(x, qw, sw * 1.01), ours) > 5e-3  # a wrong scale is caught


def test_fp8_linear_from_linear():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g) / 8)
        lin.bias.copy_(torch.randn(96, generator=g))
    q = Fp8Linear.from_linear(lin)
    assert q.weight.dtype == FP8 and q.weight.shape == (96, 64) and q.weight_scale.shape == (96,)
    assert torch.equal(q.bias, lin.bias)
    x = torch.randn(3, 5, 64, generator=g)
    y, ref = q(x), lin(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    # W8A8 with 3-bit mantissas: ~3.5 % relative error on Gaussian data; well above fp32 noise
    assert 0.01 < _rel(y - lin.bias, ref - lin.bias) < 0.05


def test_fp8_experts_reference_matches_per_token_math():
    """Written out per (token, slot): quantize the token, expert GEMM, SwiGLU, quantize, GEMM."""
    e_, h_, i_, n, k = 5, 32, 16, 23, 2
    g = torch.Generator().manual_seed(3)
    plain = Experts(e_, h_, i_)
    with torch.no_grad():
        plain.gate_and_up_proj.copy_(torch.randn(e_, 2 * i_, h_, generator=g) * h_ ** -0.5)
        plain.down_proj.copy_(torch.randn(e_, h_, i_, generator=g) * i_ ** -0.5)
    fp8 = Fp8Experts.from_experts(plain)
    x = torch.randn(n, h_, generator=g)
    experts = torch.stack([torch.randint(0, 3, (n,), generator=g), torch.full((n,), 4)], 1)  # expert 3 idle
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    out = fp8(x, weights, experts, "loop")

    def deq(q_s):
        return q_s[0].double() * q_s[1].double().unsqueeze(-1)

    ref = torch.zeros(n, h_, dtype=torch.float64)
    for t in range(n):
        xt = deq(quantize_rowwise(x[t:t + 1]))
        for s in range(k):
            e = int(experts[t, s])
            w1 = deq((fp8.gate_and_up_proj[e], fp8.gate_and_up_proj_scale[e]))
            w2 = deq((fp8.down_proj[e], fp8.down_proj_scale[e]))
            hid = xt @ w1.T
            act = hid[:, :i_] * F.silu(hid[:, i_:])
            ref[t] += weights[t, s].double() * (deq(quantize_rowwise(act.float())) @ w2.T)[0]
    assert _rel(out, ref) < 1e-5
    unquantized = plain(x, weights, experts, "loop")
    assert 0.01 < _rel(out, unquantized) < 0.1


# -- which modules, memory, dtype handling --------------------------------------------------------
def test_quantize_model_swaps_exactly_the_decoder_linears_and_experts(tiny_plain, tiny_fp8):
    names = dict(fp8_modules(tiny_fp8))
    layers = tiny_plain.config.num_hidden_layers
    expected = {f"model.layers.{i}.{n}" for i in range(layers) for n in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_and_up_proj", "mlp.shared_mlp.down_proj",
        "mlp.experts")}
    assert set(names) == expected
    for i in range(layers):
        gate = tiny_fp8.model.layers[i].mlp.gate.wg
        assert type(gate) is nn.Linear and gate.weight.dtype == torch.float32  # the router stays as it is
    plain_linears = [n for n, m in tiny_fp8.named_modules() if type(m) is nn.Linear]
    assert any(n.startswith("timestep_emb") for n in plain_linears) and "lm_head" in plain_linears
    assert any(n.startswith("vision_aligner") for n in plain_linears)
    # everything outside the quantized modules is bitwise the plain model
    plain_sd, fp8_sd = tiny_plain.state_dict(), tiny_fp8.state_dict()
    outside = [k for k in plain_sd if not any(k.startswith(n + ".") for n in expected)]
    assert outside and all(torch.equal(plain_sd[k], fp8_sd[k]) for k in outside)
    before = copy.deepcopy(tiny_fp8)
    quantize_model_fp8_(tiny_fp8)  # idempotent
    assert _same_state(before, tiny_fp8)


def test_dtype_casts_move_but_never_cast_fp8_weights_and_scales(tiny_fp8):
    model = copy.deepcopy(tiny_fp8)
    model.to(torch.bfloat16)
    layer, ref = model.model.layers[0], tiny_fp8.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert torch.equal(_bits(layer.self_attn.qkv_proj.weight), _bits(ref.self_attn.qkv_proj.weight))
    assert layer.mlp.experts.down_proj_scale.dtype == torch.float32
    assert torch.equal(layer.mlp.experts.down_proj_scale, ref.mlp.experts.down_proj_scale)
    assert layer.input_layernorm.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    model.float()
    assert layer.mlp.experts.gate_and_up_proj.dtype == FP8


def test_full_size_fp8_model_takes_half_the_bytes():
    """Full 80B dimensions on the meta device (no memory): the quantized decoder layers take half their
    bf16 bytes (+0.1 % for the scales) and the whole model fits one 141 GB H200 with room to spare."""
    cfg = get_config("hunyuan-image-3")
    with torch.device("meta"):
        model = HunyuanImage3ForCausalMM(cfg).to(torch.bfloat16)
    bf16_total, bf16_layers = weight_bytes(model), weight_bytes(model.model.layers)
    quantize_model_fp8_(model)
    fp8_total, fp8_layers = weight_bytes(model), weight_bytes(model.model.layers)
    print(f"\nfull size: bf16 {bf16_total / 1e9:.1f} GB -> fp8 {fp8_total / 1e9:.1f} GB "
          f"(decoder layers {bf16_layers / 1e9:.1f} -> {fp8_layers / 1e9:.1f} GB)")
    assert 0.5 < fp8_layers / bf16_layers < 0.502
    assert fp8_total / bf16_total < 0.53 and fp8_total < 90e9 and bf16_total > 150e9


# -- building, checkpoints ------------------------------------------------------------------------
def test_build_model_fp8_dummy_equals_quantized_plain_model(tiny_plain, tiny_fp8):
    built = build_model_fp8(tiny_plain.config, "cpu", seed=0)
    assert _same_state(built, tiny_fp8)
    other = build_model_fp8(tiny_plain.config, "cpu", seed=1)
    assert not torch.equal(_bits(other.model.layers[0].mlp.experts.down_proj), _bits(built.model.layers[0].mlp.experts.down_proj))


def _layer_outputs(model: HunyuanImage3ForCausalMM) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, model.config.hidden_size, generator=g)
    pos = torch.arange(7.0).view(1, 7, 1).expand(2, 7, 2)
    with torch.no_grad():
        return model.forward_layers(x, pos, None, None)


def test_fp8_checkpoint_round_trip(tmp_path, tiny_plain, tiny_fp8):
    ckpt = save_pretrained_fp8(tiny_fp8, tiny_plain.config, tmp_path / "fp8")
    assert is_fp8_checkpoint(ckpt) and not is_fp8_checkpoint(tmp_path)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    tensors = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    w = "model.layers.1.mlp.experts.3.down_proj"
    assert tensors[f"{w}.weight"].dtype == FP8 and tensors[f"{w}.weight_scale"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert tensors["model.layers.0.mlp.gate.wg.weight"].dtype == torch.float32
    fp8_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    plain_dir = save_pretrained(tiny_plain, tiny_plain.config, tmp_path / "plain")
    plain_bytes = sum(f.stat().st_size for f in plain_dir.glob("*.safetensors"))
    assert fp8_bytes < plain_bytes

    loaded = build_model_fp8(tiny_plain.config, "cpu", weights=ckpt)
    assert _same_state(loaded, tiny_fp8)
    assert torch.equal(_layer_outputs(loaded), _layer_outputs(tiny_fp8))
    # a plain (fp32/bf16) checkpoint is quantized tensor by tensor while it loads: the same model
    from_plain = build_model_fp8(tiny_plain.config, "cpu", weights=plain_dir)
    assert _same_state(from_plain, tiny_fp8)


def test_fp8_checkpoint_scale_formats_and_errors(tmp_path, tiny_plain, tiny_fp8):
    """Per-tensor, [out, 1] per-channel and block-wise `weight_scale_inv` scales load to the weights
    they describe; an FP8 weight without a scale is an error naming it."""
    ckpt = save_pretrained_fp8(tiny_fp8, tiny_plain.config, tmp_path / "fp8")
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(str(shard))
    plain = dict(tiny_plain.named_parameters())
    # per-tensor: one scale for the whole qkv weight of layer 0
    name = "model.layers.0.self_attn.qkv_proj"
    w = plain[f"{name}.weight"].detach()
    st = w.abs().max() / 448
    tensors[f"{name}.weight"] = (w / st).to(FP8)
    tensors[f"{name}.weight_scale"] = st.reshape(())
    expect = {name: tensors[f"{name}.weight"].float() * st}
    # [out, 1]: compressed-tensors' channel layout
    name = "model.layers.0.self_attn.o_proj"
    tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"].unsqueeze(1)
    expect[name] = tiny_fp8.get_submodule(name).dequantized_weight()
    # block-wise 32 x 32 (DeepSeek-style), re-quantized per channel at load
    name = "model.layers.1.mlp.experts.2.gate_and_up_proj"
    w = tiny_plain.model.layers[1].mlp.experts.gate_and_up_proj[2].detach()
    blocks = w.reshape(4, 32, 2, 32).abs().amax((1, 3)) / 448
    full = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
    tensors[f"{name}.weight"] = (w / full).to(FP8)
    del tensors[f"{name}.weight_scale"]
    tensors[f"{name}.weight_scale_inv"] = blocks
    block_deq = tensors[f"{name}.weight"].float() * full
    tensors["model.layers.1.self_attn.o_proj.input_scale"] = torch.tensor(0.5)  # static: ignored
    save_file(tensors, str(shard))

    model = build_model_fp8(tiny_plain.config, "cpu", weights=ckpt)
    for n in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"):
        assert torch.equal(model.get_submodule(n).dequantized_weight(), expect[n])
    experts = model.model.layers[1].mlp.experts
    got = dequantize(experts.gate_and_up_proj[2], experts.gate_and_up_proj_scale[2])
    assert torch.equal(got, dequantize(*quantize_rowwise(block_deq)))

    del tensors["model.layers.0.mlp.shared_mlp.down_proj.weight_scale"]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"without a weight_scale.*shared_mlp\.down_proj"):
        build_model_fp8(tiny_plain.config, "cpu", weights=ckpt)


# -- end to end -----------------------------------------------------------------------------------
def test_fp8_tiny_generation_against_unquantized(monkeypatch):
    """The tiny DiT with FP8 weights against the unquantized fp32 model, from the same AR output
    (8 steps, CFG 5, recompute path). Threshold: image PSNR >= 30 dB, latents within 15 %.

    Measured on this model (CPU, 2026-11-23): 34.8 dB / 10 % for this prompt; 33.6-37.4 dB and
    7-12 % over 12 more prompt x seed pairs (T2I and IT2I). bf16 against fp32 gives 38-39 dB on the
    same model: its random weights and CFG 5 amplify every rounding, so it is a stress test. 30 dB
    sits 3.6 dB under the worst measured pair (1.5x its RMS error); a structural bug such as swapped
    SwiGLU halves gives 26.7 dB. Control: E5M2 (one mantissa bit fewer) on the same prompt must come
    out clearly worse (measured 31.2 dB)."""
    from components.engine import ARRequest, DiTRequest, SamplingParams

    engine = tiny_engine()
    ar = engine.generate_ar([ARRequest("fp8", "a red fox in the snow", [])], SamplingParams(max_new_tokens=16))[0]
    base = engine.dit(DiTRequest(ar, [], None, steps=8, seed=1))

    def quantized_run(fmt: torch.dtype, fmt_max: float) -> tuple[float, float]:
        with monkeypatch.context() as m:
            m.setattr(quant, "FP8", fmt)
            m.setattr(quant, "FP8_MAX", fmt_max)
            model = copy.deepcopy(engine.model)
            quantize_model_fp8_(model)
            out = dataclasses.replace(engine, model=model).dit(DiTRequest(ar, [], None, steps=8, seed=1))
        return psnr(base.image, out.image), _rel(out.latents, base.latents)

    db, rel = quantized_run(torch.float8_e4m3fn, 448.0)
    db_e5m2, rel_e5m2 = quantized_run(torch.float8_e5m2, 57344.0)
    print(f"\ntiny DiT vs fp32: e4m3 {db:.2f} dB, latents {rel:.4f}; e5m2 {db_e5m2:.2f} dB, latents {rel_e5m2:.4f}")
    assert db >= 30.0 and rel <= 0.15
    assert db - db_e5m2 >= 2.0 and rel_e5m2 > 1.3 * rel


def test_moe_module_runs_fp8_experts_through_its_hook(tiny_fp8, tiny_plain):
    """MoE.forward hands routing to its experts module: the FP8 one is used, with the same routing."""
    moe: MoE = tiny_fp8.model.layers[0].mlp
    plain: MoE = tiny_plain.model.layers[0].mlp
    x = torch.randn(2, 9, tiny_plain.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out, ref = moe(x), plain(x)
        w, e = moe.route(x.reshape(-1, x.shape[-1]))
        routed = fp8_moe_reference(x.reshape(-1, x.shape[-1]), w, e, moe.experts.gate_and_up_proj,
                                   moe.experts.gate_and_up_proj_scale, moe.experts.down_proj,
                                   moe.experts.down_proj_scale)
    assert torch.allclose(out, moe.shared_mlp(x) + routed.view_as(x), rtol=0, atol=1e-6)
    assert 0.01 < _rel(out, ref) < 0.1


def _emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                                out_dtype=None, use_fast_accum=False):
    """`torch._scaled_grouped_mm` (2-D x 3-D, rowwise) for the CPU, with the argument checks of the
    CUDA kernel (torch 2.11 GroupedBlas.cpp): row-major A, transposed B, 1-D A scale, [G, N] B scale,
    int32 offsets, bf16 out."""
    assert mat_a.dtype == mat_b.dtype == FP8 and mat_a.dim() == 2 and mat_b.dim() == 3
    assert mat_a.stride(1) == 1 and mat_b.stride(1) == 1, "A row-major, B transposed"
    assert mat_a.shape[1] == mat_b.shape[1] and mat_a.shape[1] % 16 == 0 and mat_b.shape[2] % 16 == 0
    assert scale_a.shape == (mat_a.shape[0],) and scale_a.is_contiguous() and scale_a.dtype == torch.float32
    assert scale_b.shape == (mat_b.shape[0], mat_b.shape[2]) and scale_b.stride(1) == 1
    assert offs.dtype == torch.int32 and offs.dim() == 1 and out_dtype == torch.bfloat16 and bias is None
    out = torch.empty(mat_a.shape[0], mat_b.shape[2], dtype=torch.bfloat16)
    start = 0
    for g, end in enumerate(offs.tolist()):
        prod = mat_a[start:end].float() @ mat_b[g].float()
        out[start:end] = (prod * scale_a[start:end, None] * scale_b[g][None, :]).to(torch.bfloat16)
        start = end
    return out


@pytest.mark.parametrize("combine", ["compiled", "bmm"])
def test_fused_path_plumbing_on_cpu(monkeypatch, tiny_fp8, combine):
    """The fused path's permutation, FP8 gathers and combine, run on the CPU with an emulated grouped
    kernel (the real one is CUDA-only) and the quantize functions uncompiled (kernels.compiled runs
    them eagerly on the CPU); the dense fused path
    runs the real `torch._scaled_mm` where the CPU build has it. Both must equal the reference."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    moe = copy.deepcopy(tiny_fp8.model.layers[1].mlp).to(torch.bfloat16)
    moe.gate.float()  # the router stays fp32, as in the engine
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, moe.experts.hidden, generator=g).to(torch.bfloat16)
    w, e = moe.route(x)
    e[0] = torch.tensor([0, 3])  # token 0 sorts into the first and the last group
    args = (x, w, e, moe.experts.gate_and_up_proj, moe.experts.gate_and_up_proj_scale, moe.experts.down_proj,
            moe.experts.down_proj_scale)
    with torch.no_grad():
        fused = quant.fp8_moe_fused(*args, combine=combine)
        ref = fp8_moe_reference(*args)
        shuffled = quant.fp8_moe_fused(x, w, e.roll(1, dims=1), *args[3:], combine=combine)
    assert fused.dtype == torch.bfloat16 and fused.shape == x.shape
    # the fused path rounds each expert's output to bf16 before the combine, the reference once at
    # the end: they differ at bf16 rounding (2^-9 relative per element), nowhere near FP8's 2^-4
    assert _rel(fused, ref) < 5e-3
    assert _rel(shuffled, ref) > 1e-2  # the combine really pairs each slot with its own weight

    lin = moe.shared_mlp.gate_and_up_proj
    try:
        y = quant.fp8_linear_fused(x, lin.weight, lin.weight_scale)
    except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"torch._scaled_mm on CPU: {err}")
    assert _rel(y, fp8_linear_reference(x, lin.weight, lin.weight_scale)) < 2e-3


def _fused_stand_ins(monkeypatch, hook) -> None:
    """The fused FP8 paths taken on the CPU, with the reference products standing in for the
    CUDA-only kernels: `hook(kind, rows, use_fast_accum, y)` sees each call ("dense": its rows;
    "experts": its (token, expert) pairs) and returns the result."""

    def dense(x, weight, scale, bias=None, use_fast_accum=False):
        return hook("dense", x.shape[0], use_fast_accum, fp8_linear_reference(x, weight, scale, bias))

    def routed(x, weights, experts, *w, use_fast_accum=False, combine="compiled"):
        return hook("experts", experts.numel(), use_fast_accum, fp8_moe_reference(x, weights, experts, *w))

    monkeypatch.setattr(quant, "dense_fused_supported", lambda *a: True)
    monkeypatch.setattr(quant, "grouped_fused_supported", lambda *a: True)
    monkeypatch.setattr(quant, "fp8_linear_fused", dense)
    monkeypatch.setattr(quant, "fp8_moe_fused", routed)


def test_fast_accumulation_only_for_compute_bound_gemms_and_never_batch_invariant(monkeypatch, tiny_fp8):
    """`fp8_accum=auto`: the fused FP8 GEMMs accumulate fast from FAST_ACCUM_MIN_ROWS rows (the
    DiT's steps, prompt chunks), exactly below (AR decode) and always under batch_invariant=on; the
    routed experts count (token, expert) pairs. The fused kernels are CUDA-only: recorders stand in."""
    from components.engine import kernels

    seen: list[tuple[str, int, bool]] = []

    def record(kind: str, rows: int, fast: bool, y: torch.Tensor) -> torch.Tensor:
        seen.append((kind, rows, fast))
        return y

    _fused_stand_ins(monkeypatch, record)
    lin = Fp8Linear.from_linear(nn.Linear(32, 16))
    moe: MoE = tiny_fp8.model.layers[0].mlp
    top_k = moe.route(torch.randn(1, moe.experts.hidden))[1].shape[1]
    small, large = kernels.FAST_ACCUM_MIN_ROWS - 1, kernels.FAST_ACCUM_MIN_ROWS

    def run(spec: str) -> list[bool]:
        previous = kernels.configure(spec)
        try:
            seen.clear()
            with torch.no_grad():
                lin(torch.randn(small, 32))
                lin(torch.randn(large, 32))
                x = torch.randn(4, moe.experts.hidden)
                w, e = moe.route(x)
                moe.experts(x, w, e)
                big = torch.randn(large, moe.experts.hidden)
                moe.experts(big, *moe.route(big))
            return [fast for _, _, fast in seen]
        finally:
            kernels.configure(previous)

    assert run("fp8_accum=auto") == [False, True, False, True]
    assert [(kind, rows) for kind, rows, _ in seen] == [("dense", small), ("dense", large), ("experts", 4 * top_k),
                                                       ("experts", large * top_k)]
    assert run("fp8_accum=auto,batch_invariant=on") == [False] * 4
    assert run("fp8_accum=fast") == [True] * 4
    assert run("fp8_accum=exact") == [False] * 4
    assert run("plain") == [False] * 4
    with pytest.raises(ValueError, match="fp8_accum"):
        kernels.parse("fp8_accum=sometimes")


def test_fast_accumulation_compiles_into_one_graph_for_a_dynamic_row_count(monkeypatch):
    """Under torch.compile with a dynamic token count the accumulation choice must reach the GEMM as
    a plain bool: a SymBool there broke the graph (`_scaled_mm(): argument 'use_fast_accum' must be
    bool`) and every linear of a compiled layer region became a frame of its own (21 -> 46 frames in
    the full GPU job). The CPU build's torch._scaled_mm stands in for the CUDA kernel."""
    import torch._dynamo as dynamo

    monkeypatch.setattr(quant, "dense_fused_supported", lambda *a: True)
    lin = Fp8Linear.from_linear(nn.Linear(64, 32))
    x = torch.randn(2048, 64).to(torch.bfloat16)
    try:
        lin(x)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"torch._scaled_mm on CPU: {e}")
    dynamo.reset()
    compiled = torch.compile(lambda t: lin(t), fullgraph=True)  # a graph break raises here
    for rows in (2048, 3000, 16):
        t = torch.randn(rows, 64).to(torch.bfloat16)
        dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            assert torch.equal(compiled(t), lin(t))
    dynamo.reset()


def test_batch_invariant_rows_stay_independent_of_their_batch_under_fast_accumulation(monkeypatch):
    """`--batch-invariant` (Admission.batch_invariant, the job's flag) leaves the kernel setting
    fp8_accum=auto as it is: a GEMM's accumulation mode follows its row count, and under the flag
    every GEMM of a row is its own (its prompt chunks, its one-row decode steps), so the row's
    tokens and K/V stay bitwise those it gets alone. Recorders stand in for the CUDA-only fused
    kernels and change the result's last bits in fast mode, as the tensor cores' accumulator does;
    FAST_ACCUM_MIN_ROWS is lowered so that the tiny model's prompts and a batched decode step
    (3 rows, 6 (token, expert) pairs) are fast and a one-row decode step (1 row, 2 pairs) exact.
    Control: without the flag the row shares decode steps with its neighbours, and its K/V change."""
    from components.engine import ARRequest, Engine, SamplingParams, kernels
    from components.engine import ar as ar_module
    from components.engine.ar_scheduler import Admission

    modes: set[bool] = set()

    def fast_bits(kind: str, rows: int, fast: bool, y: torch.Tensor) -> torch.Tensor:
        modes.add(fast)
        return y * (1 + 2 ** -7) if fast else y

    _fused_stand_ins(monkeypatch, fast_bits)
    monkeypatch.setattr(kernels, "FAST_ACCUM_MIN_ROWS", 3)
    monkeypatch.setattr(ar_module, "PREFILL_DECODED_KV", False)  # export the decode steps' own K/V
    engine = Engine.load("tiny", seed=0, quantization="fp8")
    assert engine.model.config.moe_topk[0] == 2
    keep_cot_in_tokenizer(engine, monkeypatch)  # the decoded tokens' K/V are in the exported K/V
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_new_tokens=12)
    target = ARRequest("target", "a red fox in the snow, photographed at dawn", [], bot_task="think_recaption",
                       seed=5)
    batch = [ARRequest("n1", "a cat", [], bot_task="think_recaption", seed=1), target,
             ARRequest("n2", "a lighthouse at night", [], bot_task="think_recaption", seed=2)]

    def run(requests: list, batch_invariant: bool):
        results: dict = {}
        engine.ar.stream(requests, lambda req, out: results.__setitem__(req.id, out), sampling,
                         admission=Admission(max_rows=3, batch_invariant=batch_invariant))
        out = results["target"]
        return out.generated_ids, out.prompt_kv.keys + out.prompt_kv.values

    assert kernels.settings().fp8_accum == "auto" and kernels.settings().batch_invariant == "off"
    alone_ids, alone_kv = run([target], True)
    ids, kv = run(batch, True)
    assert modes == {True, False}  # both modes ran: prompt chunks fast, one-row decode steps exact
    assert ids == alone_ids and all(torch.equal(a, b) for a, b in zip(kv, alone_kv))
    _, shared_kv = run(batch, False)  # control: decode steps of 3 rows accumulate fast
    assert not all(torch.equal(a, b) for a, b in zip(shared_kv, alone_kv))


# -- tensor parallel ------------------------------------------------------------------------------
def _tp_logits_and_latents(engine) -> dict:
    from components.engine import ARRequest, DiTRequest, SamplingParams
    from components.engine.transformer import attention_mask

    ar = engine.generate_ar([ARRequest("tp", "a red cat on a sofa", [], seed=1)], SamplingParams(max_new_tokens=4))[0]
    ids = ar.prompt_ids
    t = len(ids)
    slots, none = torch.arange(t).unsqueeze(0), torch.full((1, t), -1)
    positions = torch.arange(t, dtype=torch.float64).unsqueeze(-1).repeat(1, 2).unsqueeze(0)
    with torch.no_grad():
        hidden = engine.model.forward_layers(engine.model.embed_ids(torch.tensor([ids])), positions,
                                             attention_mask(slots, slots, none, none), None)
        logits = engine.model.text_logits(hidden)[0]
    dit = engine.dit(DiTRequest(ar, [], None, steps=2, seed=1))
    return {"logits": logits, "latents": dit.latents, "tokens": ar.generated_ids}


def _tp_rank(rank: int, world: int, port: int, outdir: str) -> None:
    import pickle

    import torch.distributed as dist

    from components.engine import Engine
    from components.runtime.parallel import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        engine = Engine.load("tiny", tensor_parallel_size=world, parallel=ParallelContext(rank, world, torch.device("cpu")),
                             quantization="fp8")
        kinds = sorted({type(m).__name__ for _, m in fp8_modules(engine.model)})
        with open(f"{outdir}/rank{rank}.pkl", "wb") as f:
            pickle.dump({**_tp_logits_and_latents(engine), "kinds": kinds}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fp8_tensor_parallel_two_ranks(tmp_path):
    """TP2 + FP8 on gloo: every decoder linear quantized (o_proj as the row-parallel FP8 linear, whose
    all-reduce and bias order are checked here), results as close to unquantized TP1 as TP1 FP8 is.
    Not bitwise TP1 FP8: a row-parallel weight's scales span only the rank's input columns."""
    import pickle
    import socket

    import torch.multiprocessing as mp

    from components.engine import Engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(2)]
    plain = _tp_logits_and_latents(Engine.load("tiny"))
    tp1 = _tp_logits_and_latents(Engine.load("tiny", quantization="fp8"))
    assert ranks[0]["kinds"] == ["Fp8Experts", "Fp8Linear", "Fp8RowParallelLinear"]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"]) and torch.equal(ranks[0]["latents"], ranks[1]["latents"])
    tp2 = ranks[0]
    for key in ("logits", "latents"):
        err_tp1, err_tp2 = _rel(tp1[key], plain[key]), _rel(tp2[key], plain[key])
        print(f"\n{key}: fp8 TP1 vs fp32 {err_tp1:.4f}, fp8 TP2 vs fp32 {err_tp2:.4f}, TP2 vs TP1 {_rel(tp2[key], tp1[key]):.4f}")
        assert 0 < err_tp2 < 2 * err_tp1 + 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("block_scales", [False, True])
def test_fp8_checkpoint_loads_on_tensor_parallel_ranks(tmp_path, tiny_plain, tiny_fp8, block_scales):
    """An FP8 checkpoint (per-channel or block-wise scales) loads on TP2 ranks: each rank reads its
    slices of the FP8 weights, the scales follow the output rows (whole for row-parallel layers),
    its experts only: every rank's tensors are bitwise the slices of the unsliced model (checked on the
    ranks). Outputs differ from TP1 only by the row-parallel layers' per-slice activation scales."""
    from components.engine import Engine
    from components.runtime.ranks import run_on_ranks
    from tests.fixtures_checkpoint import write_tiny_checkpoint_files

    ckpt = save_pretrained_fp8(tiny_fp8, tiny_plain.config, tmp_path / "fp8")
    if block_scales:  # rewrite the dense projections with 2x2-block scales (DeepSeek-style weight_scale_inv)
        _to_block_scales(ckpt)
    write_tiny_checkpoint_files(ckpt)  # tokenizer, generation config: a loadable model directory
    tp1_engine = Engine.load(str(ckpt))
    # The ranks' tensors are checked against this unsliced model (tests.parallel_targets) and the
    # outputs against its own: so first check the FP8 loader itself against an independent
    # dequantization (plain torch from the safetensors on disk), or a bug it shares with the
    # ranks would widen its own tolerance.
    _assert_loader_matches_disk(tp1_engine.model, _dequantize_from_disk(ckpt), block_scaled=block_scales)
    tp1 = _tp_logits_and_latents(tp1_engine)
    tp2 = run_on_ranks(parallel_targets.fp8_checkpoint_logits, {"checkpoint": str(ckpt)}, world_size=2,
                       device="cpu")
    plain = _tp_logits_and_latents(Engine.load("tiny"))
    for key in ("logits", "latents"):
        err_tp1, err_tp2 = _rel(tp1[key], plain[key]), _rel(tp2[key], plain[key])
        assert 0 < err_tp2 < 2 * err_tp1 + 1e-3, key  # as close to fp32 as TP1 FP8 is


def _dequantize_from_disk(ckpt) -> dict[str, torch.Tensor]:
    """Every FP8 weight of a checkpoint in fp32, computed with plain torch from the safetensors:
    weight x scale, the scale per tensor, per output channel ([out] or [out, 1]) or, for
    `weight_scale_inv`, per block."""
    out = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            if t.dtype != FP8:
                continue
            w = t.float()
            if f"{name}_scale_inv" in tensors:
                blocks = tensors[f"{name}_scale_inv"].float()
                rows, cols = -(-w.shape[0] // blocks.shape[0]), -(-w.shape[1] // blocks.shape[1])
                scale = blocks.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
            else:
                scale = tensors[f"{name}_scale"].float()
                scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
            out[name] = w * scale
    return out


def _assert_loader_matches_disk(model, disk: dict[str, torch.Tensor], block_scaled: bool) -> None:
    """The loaded FP8 weights, dequantized, equal the checkpoint's: exactly for per-channel scales;
    for block scales (re-quantized per channel at load) within E4M3's rounding of each row."""
    loaded = {}
    for name, module in fp8_modules(model):
        if isinstance(module, Fp8Experts):
            for proj in ("gate_and_up_proj", "down_proj"):
                weights, scales = getattr(module, proj), getattr(module, f"{proj}_scale")
                for e in range(weights.shape[0]):
                    loaded[f"{name}.{e}.{proj}.weight"] = dequantize(weights[e], scales[e])
        else:
            loaded[f"{name}.weight"] = module.dequantized_weight()
    assert set(loaded) == set(disk)  # every FP8 weight on disk, and nothing else
    for name, want in disk.items():
        got = loaded[name]
        if block_scaled and name.endswith("qkv_proj.weight"):
            # half an E4M3 step (1/16 relative) of the row's largest value, re-quantized per row
            bound = want.abs().amax(dim=1, keepdim=True) / 16
            assert ((got - want).abs() <= bound).all(), name
        else:
            assert torch.equal(got, want), name


def _to_block_scales(ckpt) -> None:
    """Replace each qkv_proj's per-channel weight_scale by an equivalent block-wise weight_scale_inv."""
    from safetensors.torch import save_file

    for path in ckpt.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [n for n in tensors if n.endswith("qkv_proj.weight_scale")]:
            scale = tensors.pop(name).float().reshape(-1)
            weight = tensors[name.replace("weight_scale", "weight")]
            w = weight.float() * scale[:, None]
            out, inp = w.shape
            blocks = w.reshape(out // 2, 2, inp // 2, 2).abs().amax(dim=(1, 3)) / 448.0
            blocks = blocks.clamp_min(1e-12)
            grid = blocks.repeat_interleave(2, 0).repeat_interleave(2, 1)
            tensors[name.replace("weight", "weight") + "_inv"] = blocks
            tensors[name.replace("weight_scale", "weight")] = (w / grid).clamp(-448, 448).to(FP8)
        save_file(tensors, str(path), metadata={"format": "pt"})


def test_fp8_kv_is_not_reused_by_a_bf16_engine():
    """FP8 weights give other K/V than full-precision ones: the payload's hash says which, and a DiT
    with the other weight format recomputes (with the reason) instead of reusing it."""
    from components.engine import Engine
    from components.engine.ar import ARRequest, SamplingParams
    from components.engine.dit import DiTRequest

    fp8, plain = Engine.load("tiny", quantization="fp8"), Engine.load("tiny")
    assert fp8.config_hash != plain.config_hash
    out = fp8.generate_ar([ARRequest("r", "a red boat", seed=1)], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert out.prompt_kv.config_hash == fp8.config_hash
    res = plain.dit(DiTRequest(out, [], out.prompt_kv, steps=1))
    assert res.kv_path == "recompute" and res.kv_reason.startswith(f"config hash {fp8.config_hash}")
    assert fp8.dit(DiTRequest(out, [], out.prompt_kv, steps=1)).kv_path == "reuse"
