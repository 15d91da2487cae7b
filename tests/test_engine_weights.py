"""Weights: official checkpoint names, sharded safetensors round trip, clear errors, and the
full-size layer stack's parameter count (built on the meta device)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from components.engine import Engine
from components.engine.config import get_config, tiny_config
from components.engine.transformer import HunyuanImage3ForCausalMM
from components.engine.weights import (INDEX_FILE, CheckpointError, LoadSlices, init_dummy_weights, load_pretrained,
                                       official_tensors, save_pretrained)

from .test_engine_helpers import tiny_engine


def _model(seed: int) -> HunyuanImage3ForCausalMM:
    torch.manual_seed(seed)
    m = HunyuanImage3ForCausalMM(tiny_config()).eval()
    init_dummy_weights(m, seed)
    return m


@pytest.fixture(scope="module")
def source():
    return _model(0)


@pytest.fixture(scope="module")
def sharded(source, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_sharded")
    save_pretrained(source, source.config, d, max_shard_bytes=256 << 10)
    return d


@pytest.fixture(scope="module")
def single(source, tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_single")
    save_pretrained(source, source.config, d)
    return d


def _forward(m: HunyuanImage3ForCausalMM) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 9, m.config.hidden_size, generator=g)
    pos = torch.arange(9, dtype=torch.float64).unsqueeze(-1).repeat(1, 2).unsqueeze(0)
    with torch.no_grad():
        h = m.forward_layers(x, pos, None, None)
        return torch.cat([m.text_logits(h).flatten(), m.image_output(h[:, 1:], torch.tensor([500.0]), 2, 4).flatten()])


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_round_trip_into_a_differently_seeded_model(source, request, layout):
    directory = request.getfixturevalue(layout)
    fresh = _model(1)
    assert not torch.equal(fresh.model.wte.weight, source.model.wte.weight)  # really different to start with
    assert not torch.equal(_forward(fresh), _forward(source))
    load_pretrained(fresh, directory)
    _assert_same_state(fresh, source)
    assert torch.equal(_forward(fresh), _forward(source))
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_experts"] == 4 and cfg["vae"]["latent_channels"] == 32


def test_shards_and_index(source, sharded):
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 3
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((sharded / INDEX_FILE).read_text())
    expected = dict(official_tensors(source))
    assert set(index["weight_map"]) == set(expected)
    total = 0
    for fname in files:
        with safe_open(str(sharded / fname), framework="pt") as f:
            names = set(f.keys())
            assert names == {k for k, v in index["weight_map"].items() if v == fname}
            for name in names:
                t = f.get_tensor(name)
                assert torch.equal(t, expected[name]), name
                total += t.numel() * t.element_size()
        # no shard is larger than the limit unless it holds a single tensor
        assert (sharded / fname).stat().st_size <= (256 << 10) + 64 * 1024 or len(names) == 1
    assert index["metadata"]["total_size"] == total


def test_official_names(source, single):
    with safe_open(str(single / "model-00001-of-00001.safetensors"), framework="pt") as f:
        names = set(f.keys())
        cfg = source.config
        hidden, inter = cfg.hidden_size, cfg.layer("moe_intermediate_size", 0)
        for e in range(cfg.num_experts):
            gate_up = f.get_tensor(f"model.layers.0.mlp.experts.{e}.gate_and_up_proj.weight")
            down = f.get_tensor(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
            assert gate_up.shape == (2 * inter, hidden) and down.shape == (hidden, inter)
            assert torch.equal(gate_up, source.model.layers[0].mlp.experts.gate_and_up_proj[e])
            assert torch.equal(down, source.model.layers[1].mlp.experts.down_proj[e])
    for name in [
        "model.wte.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.query_layernorm.weight",
        "model.layers.0.self_attn.key_layernorm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.gate.wg.weight",
        "model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight",
        "model.layers.0.mlp.shared_mlp.down_proj.weight",
        "model.layers.0.mlp.experts.3.gate_and_up_proj.weight",
        "model.layers.1.mlp.experts.0.down_proj.weight",
        "patch_embed.model.0.weight",
        "final_layer.model.1.2.weight",
        "timestep_emb.mlp.0.weight",
        "time_embed.mlp.2.weight",
        "time_embed_2.mlp.2.weight",
        "lm_head.weight",
        "model.ln_f.weight",
    ]:
        assert name in names, name
    # routed experts only under their per-expert names (no stacked tensors in the checkpoint)
    assert not any(re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(gate_and_up_proj|down_proj)", n) for n in names)
    assert any(n.startswith("vae.") for n in names) and any(n.startswith("vision_model.") for n in names)
    assert any(n.startswith("vision_aligner.") for n in names)
    shapes = {"model.layers.0.self_attn.qkv_proj.weight": ((4 + 2 * 2) * 16, 64),
              "model.layers.0.mlp.gate.wg.weight": (4, 64), "lm_head.weight": (1024, 64)}
    with safe_open(str(single / "model-00001-of-00001.safetensors"), framework="pt") as f:
        for name, shape in shapes.items():
            assert tuple(f.get_slice(name).get_shape()) == shape


def _rewrite(directory, fn):
    path = directory / "model-00001-of-00001.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_a_clear_error(source, tmp_path):
    save_pretrained(source, source.config, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.2.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 model tensor\(s\) missing .*model\.layers\.1\.mlp\.experts\.2\.down_proj"):
        load_pretrained(_model(1), tmp_path)
    load_pretrained(_model(1), tmp_path, strict=False)  # tolerated when not strict


def test_unexpected_and_misshaped_tensors_are_clear_errors(source, tmp_path):
    save_pretrained(source, source.config, tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"1 checkpoint tensor\(s\) the model has no place for .*model\.layers\.9"):
        load_pretrained(_model(1), tmp_path)
    _rewrite(tmp_path, lambda t: (t.pop("model.layers.9.extra.weight"),
                                  t.__setitem__("model.ln_f.weight", torch.ones(65))))
    with pytest.raises(CheckpointError, match=r"model\.ln_f\.weight has shape \(65,\), the model built from config.json expects \(64,\)"):
        load_pretrained(_model(1), tmp_path)


def test_no_checkpoint_files_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(_model(1), tmp_path)


def test_engine_loads_saved_weights(tmp_path):
    eng = tiny_engine()
    save_pretrained(eng.model, eng.config, tmp_path, max_shard_bytes=1 << 20)
    loaded = Engine.load("tiny", weights=tmp_path, seed=123)
    _assert_same_state(loaded.model, eng.model)
    assert loaded.model.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32


def test_dummy_init_is_seeded_and_has_signal():
    a, b = _model(0), _model(0)
    _assert_same_state(a, b)
    w = a.model.layers[0].self_attn.qkv_proj.weight
    assert w.std().item() == pytest.approx(64 ** -0.5, rel=0.15)  # N(0, 1/fan_in)
    assert a.final_layer.model[1][2].weight.abs().max() > 0  # output conv random, not zero
    assert torch.equal(a.model.layers[0].input_layernorm.weight, torch.ones(64))


# --------------------------------------------------------------------------- full size on meta
def test_full_size_layer_parameter_count_on_meta():
    cfg = get_config("hunyuan-image-3")
    with torch.device("meta"):
        m = HunyuanImage3ForCausalMM(cfg, with_conditioning=False)
    assert not hasattr(m, "vae") and not hasattr(m, "vision_model")
    layer = m.model.layers[0]
    assert all(p.is_meta for p in layer.parameters())
    attention = (32 + 2 * 8) * 128 * 4096 + 32 * 128 * 4096 + 2 * 128  # qkv, o_proj, Q/K norms
    moe = 64 * 3 * 4096 * 3072 + 3 * 4096 * 3072 + 4096 * 64  # routed, shared, router
    norms = 2 * 4096
    assert sum(p.numel() for p in layer.parameters()) == attention + moe + norms == 2_495_881_472
    assert len(m.model.layers) == 32
    assert m.model.wte.weight.shape == (133120, 4096) and m.lm_head.weight.shape == (133120, 4096)
    # ~80B total parameters in the stack (13B active: top-8 of 64 experts)
    total = sum(p.numel() for p in m.parameters())
    assert 79e9 < total < 82e9


def test_missing_shard_named_in_the_index_is_a_clear_error(source, sharded, tmp_path):
    import shutil

    for f in sharded.iterdir():
        shutil.copy(f, tmp_path / f.name)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"lacks 1 shard.*{victim.name}.*incomplete"):
        load_pretrained(_model(1), tmp_path)


def test_sliced_model_reads_only_its_slices(source, sharded):
    """A model whose tensors are ranges of the full ones (tensor/expert parallel) reads exactly those
    ranges with get_slice, and dummy init draws the same slices as the unsliced init."""
    full = source.model.layers[0]
    name_qkv = "model.layers.0.self_attn.qkv_proj.weight"
    name_down = "model.layers.0.mlp.shared_mlp.down_proj.weight"
    name_gu = "model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight"
    name_experts = "model.layers.0.mlp.experts.gate_and_up_proj"
    rows_qkv = [(0, 48)]
    cols_down = [(16, 48)]
    halves = [(0, 32), (64, 96)]  # a fused gate/up projection split per half

    class Holder(torch.nn.Module):
        pass

    m = Holder()
    m.model = Holder()
    m.model.layers = torch.nn.ModuleList([Holder()])
    layer = m.model.layers[0]
    layer.self_attn = Holder()
    layer.self_attn.qkv_proj = torch.nn.Linear(64, 48, bias=False)
    layer.mlp = Holder()
    layer.mlp.shared_mlp = Holder()
    layer.mlp.shared_mlp.down_proj = torch.nn.Linear(32, 64, bias=False)
    layer.mlp.shared_mlp.gate_and_up_proj = torch.nn.Linear(64, 64, bias=False)
    layer.mlp.experts = Holder()
    layer.mlp.experts.gate_and_up_proj = torch.nn.Parameter(torch.zeros(2, 128, 64))
    m.load_slices = LoadSlices(ranges={name_qkv: (0, rows_qkv, 128), name_down: (1, cols_down, 64),
                                       name_gu: (0, halves, 128)},
                               experts={name_experts: (2, 4)})
    load_pretrained(m, sharded, strict=False)
    assert torch.equal(layer.self_attn.qkv_proj.weight, full.self_attn.qkv_proj.weight[0:48])
    assert torch.equal(layer.mlp.shared_mlp.down_proj.weight, full.mlp.shared_mlp.down_proj.weight[:, 16:48])
    gu = full.mlp.shared_mlp.gate_and_up_proj.weight
    assert torch.equal(layer.mlp.shared_mlp.gate_and_up_proj.weight, torch.cat([gu[0:32], gu[64:96]]))
    assert torch.equal(layer.mlp.experts.gate_and_up_proj, full.mlp.experts.gate_and_up_proj[2:4])
    # dummy weights: the sliced draw equals the slice of the full draw
    init_dummy_weights(m, 0)
    assert torch.equal(layer.self_attn.qkv_proj.weight, full.self_attn.qkv_proj.weight[0:48])
    assert torch.equal(layer.mlp.shared_mlp.down_proj.weight, full.mlp.shared_mlp.down_proj.weight[:, 16:48])
    assert torch.equal(layer.mlp.experts.gate_and_up_proj, full.mlp.experts.gate_and_up_proj[2:4])


def test_load_reports_peak_host_memory(source, sharded):
    stats = load_pretrained(_model(1), sharded)
    assert stats.tensors == len(dict(official_tensors(source)))
    assert stats.bytes_read > 0 and stats.peak_host_rss_gb > 0
