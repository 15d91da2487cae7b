"""The fit check's K/V term (components/fit.py) against real K/V: the bytes a token's K and V take
in every layer, as the tiny model's AR exports them, times the planned tokens. Tiny model, CPU."""

from __future__ import annotations

import pytest

from components.engine import ARRequest, SamplingParams
from components.fit import estimate, planned_tokens

from .test_engine_helpers import tiny_engine


def test_the_planned_kv_is_the_real_kv_bytes_per_token_times_the_planned_tokens():
    engine = tiny_engine()
    out = engine.generate_ar([ARRequest("r0", "a cat", [], bot_task="think_recaption", seed=1)],
                             SamplingParams(temperature=0, max_new_tokens=4))[0]
    kv = out.prompt_kv
    tokens = kv.keys[0].shape[0]
    assert kv.num_layers == engine.config.num_hidden_layers and tokens == len(kv.token_ids) > 0
    per_token = sum(t.nbytes for t in kv.keys + kv.values) / tokens  # K and V, every layer and KV head

    batch, max_new, cfg_rows = 8, 64, 2
    prompt, cot, image = planned_tokens(engine.config, "edit", max_new)
    need = estimate(engine.config, 0.0, batch_size=batch, kind="edit", max_new_tokens=max_new, cfg_rows=cfg_rows)
    ar_kv, dit_kv = batch * (prompt + cot) * per_token, cfg_rows * (prompt + cot + image) * per_token
    assert need.kv in (pytest.approx(ar_kv, rel=1e-9), pytest.approx(dit_kv, rel=1e-9)), (need.kv, ar_kv, dit_kv)
