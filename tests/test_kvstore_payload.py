"""Payload format, key rules and store URLs (no servers)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from components.engine.kvcache import PromptKV
from components.kvstore import (
    PayloadError,
    StoreError,
    check_key,
    decode_payload,
    encode_into,
    encode_payload,
    open_store,
    payload_size,
    read_header,
)
from components.kvstore.base import parse_size
from components.kvstore.local import LocalStore
from components.kvstore.payload import PREFIX_SIZE, decode_data, encode_header


def make_kv(
    dtype=torch.float32,
    layers=3,
    tokens=11,
    heads=2,
    head_dim=8,
    seed=0,
    model_id="tiny",
    config_hash="cfg1",
):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    return PromptKV(
        keys=[mk() for _ in range(layers)],
        values=[mk() for _ in range(layers)],
        token_ids=list(range(100, 100 + tokens)),
        pos_reuse_len=tokens,
        neg_reuse_len=max(1, tokens - 3),
        model_id=model_id,
        config_hash=config_hash,
        meta={"row": 3, "prompt": "a cat"},
    )


def assert_same(a: PromptKV, b: PromptKV) -> None:
    assert a.num_layers == b.num_layers and a.dtype == b.dtype
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.shape == y.shape and torch.equal(
            x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
            y.view(torch.uint8) if y.dtype == torch.bfloat16 else y,
        )
    assert (
        a.token_ids,
        a.pos_reuse_len,
        a.neg_reuse_len,
        a.model_id,
        a.config_hash,
        a.meta,
    ) == (
        b.token_ids,
        b.pos_reuse_len,
        b.neg_reuse_len,
        b.model_id,
        b.config_hash,
        b.meta,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip(dtype):
    kv = make_kv(dtype)
    p = encode_payload(kv)
    assert len(p) == payload_size(kv)
    out = decode_payload(p, "tiny", "cfg1")
    assert_same(kv, out)
    h = read_header(p)
    assert h.data_offset % 4096 == 0 and h.data_len == kv.nbytes()
    assert h.fields["dtype"] == str(dtype).split(".")[1]


@pytest.mark.parametrize("kind", ["numpy", "torch", "bytearray"])
def test_encode_into_preallocated_and_zero_copy_decode(kind):
    kv = make_kv(torch.bfloat16)
    n = payload_size(kv)
    buf = {
        "numpy": lambda: np.zeros(n + 100, np.uint8),
        "torch": lambda: torch.zeros(n + 100, dtype=torch.uint8),
        "bytearray": lambda: bytearray(n + 100),
    }[kind]()
    assert encode_into(kv, buf) == n
    out = decode_payload(buf)
    assert_same(kv, out)
    # zero-copy: the decoded tensors live inside the buffer
    base = (
        np.frombuffer(buf, np.uint8).ctypes.data
        if kind == "bytearray"
        else (buf.ctypes.data if kind == "numpy" else buf.data_ptr())
    )
    assert base <= out.keys[1].data_ptr() < base + n
    copied = decode_payload(buf, copy=True)
    assert not base <= copied.keys[1].data_ptr() < base + n
    assert_same(kv, copied)


def test_streaming_header_matches_encode():
    kv = make_kv(torch.bfloat16)
    head, views = encode_header(kv, put_time=123.0)
    assert (
        head + b"".join(v.tobytes() for v in views)
        == encode_payload(kv, put_time=123.0).tobytes()
    )


def test_decode_from_separate_header_and_data():
    kv = make_kv()
    p = encode_payload(kv)
    h = read_header(p[:4096])
    assert_same(kv, decode_data(h, p[h.data_offset :].copy()))


def test_buffer_too_small_and_readonly():
    kv = make_kv()
    with pytest.raises(ValueError, match="smaller than the payload"):
        encode_into(kv, np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        encode_into(kv, bytes(payload_size(kv)))


def _corrupt(p: np.ndarray, at: int) -> np.ndarray:
    q = p.copy()
    q[at] ^= 0xFF
    return q


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (
            lambda p: _corrupt(p, -1),
            "checksum_mismatch",
        ),  # last byte of the last V tensor
        (lambda p: _corrupt(p, PREFIX_SIZE + 5), "header_corrupt"),
        (lambda p: _corrupt(p, 0), "bad_magic"),
        (lambda p: p[:-10], "truncated"),
        (lambda p: p[:30], "truncated"),
        (
            lambda p: np.concatenate(
                [p[:8], np.frombuffer(struct.pack("<I", 99), np.uint8), p[12:]]
            ),
            "bad_version",
        ),
    ],
)
def test_corruption_is_detected(mutate, reason):
    p = encode_payload(make_kv(torch.bfloat16))
    with pytest.raises(PayloadError, match=f"^{reason}: ") as e:
        decode_payload(mutate(p))
    assert e.value.reason == reason, e.value


def test_checksum_names_the_tensor():
    kv = make_kv()
    p = encode_payload(kv)
    h = read_header(p)
    k1 = next(t for t in h.tensors if t.name == "k.1")
    with pytest.raises(PayloadError, match="tensor k.1") as e:
        decode_payload(_corrupt(p, h.data_offset + k1.offset + 3))
    assert e.value.reason == "checksum_mismatch"
    assert_same(kv, decode_payload(p, verify=True))


def test_identity_mismatch():
    p = encode_payload(make_kv())
    with pytest.raises(PayloadError, match="^model_mismatch: ") as e:
        decode_payload(p, expect_model_id="hunyuan-image-3")
    assert e.value.reason == "model_mismatch" and "tiny" in e.value.detail
    with pytest.raises(PayloadError, match="^config_mismatch: ") as e:
        decode_payload(p, "tiny", "other")
    assert e.value.reason == "config_mismatch"


def test_bad_promptkv_is_refused():
    kv = make_kv()
    kv.values[1] = kv.values[1].to(torch.float16)
    with pytest.raises(ValueError, match="layer 1: dtype"):
        payload_size(kv)
    kv = make_kv()
    kv.meta = {"x": object()}
    with pytest.raises(ValueError, match="meta must be JSON"):
        encode_payload(kv)
    kv = make_kv()
    kv.keys = [k.to(torch.int32) for k in kv.keys]
    kv.values = [v.to(torch.int32) for v in kv.values]
    with pytest.raises(ValueError, match="not supported"):
        encode_payload(kv)
    kv = make_kv()
    kv.pos_reuse_len = 3
    with pytest.raises(ValueError, match="pos_reuse_len"):
        encode_payload(kv)


def test_non_contiguous_tensors_are_encoded_by_value():
    kv = make_kv(tokens=6, heads=4)
    kv.keys = [k[:, ::2] for k in kv.keys]
    kv.values = [v[:, ::2] for v in kv.values]
    assert not kv.keys[0].is_contiguous()
    assert_same(kv, decode_payload(encode_payload(kv)))


@pytest.mark.parametrize("key", ["run/0/1", "r-1.x/3/17", "a"])
def test_good_keys(key):
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "run//1",
        "run/0/1#p",
        "../x",
        "run/../1",
        "a b",
        "/run/0",
        "r/0/",
        7,
        "x" * 600,
    ],
)
def test_bad_keys(key):
    with pytest.raises(ValueError, match="store key"):
        check_key(key)


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    s = open_store(f"local://{tmp_path}/kv")
    assert isinstance(s, LocalStore) and s.root == tmp_path / "kv"
    for bad, msg in [
        ("", "empty"),
        ("s3://b/k", "unknown scheme"),
        (f"local://{tmp_path}?x=1", "takes only ttl"),
    ]:
        with pytest.raises(ValueError, match=msg):
            open_store(bad)


def test_mooncake_url_parsing_needs_no_server():
    from components.kvstore.mooncake import config_from_url

    c = config_from_url(
        "mooncake://10.0.0.5:50051?protocol=rdma&device=mlx5_0&part=32MB&buffer=1GB&timeout=5"
    )
    assert (c.master, c.protocol, c.device, c.part, c.buffer, c.timeout) == (
        "10.0.0.5:50051",
        "rdma",
        "mlx5_0",
        32 << 20,
        1 << 30,
        5.0,
    )
    assert (
        c.metadata == "http://10.0.0.5:8080/metadata"
        and c.admin == "http://10.0.0.5:9003"
    )
    assert c.segment == 0 and c.pin == "soft" and c.pin_ttl == 6 * 3600  # a lease, not a pin forever
    assert config_from_url("mooncake://h:1?pin_ttl=30m").pin_ttl == 1800
    assert config_from_url("mooncake://h:1?pin_ttl=1500ms").pin_ttl == 1.5
    for url, msg in [
        ("mooncake://h:1?pin_ttl=soon", "pin_ttl"),
        ("mooncake://h:1?pin_ttl=48h", "24 h"),
        ("mooncake://h:1?colour=red", "unknown parameter"),
        ("mooncake://h:1?part=lots", "part"),
        ("mooncake://h:1?protocol=udp", "protocol"),
        ("mooncake://h:1?pin=maybe", "pin"),
        ("mooncake://hostonly", "HOST:PORT"),
        ("mooncake://h:1?part=1MB&part=2MB", "given 2 times"),
    ]:
        with pytest.raises(ValueError, match=msg):
            config_from_url(url)


def test_parse_size():
    assert parse_size("512MB", "x") == 512 << 20 and parse_size("2 GiB", "x") == 2 << 30
    assert parse_size("1048576", "x") == 1 << 20 and parse_size(5, "x") == 5
    with pytest.raises(ValueError, match="segment"):
        parse_size("big", "segment")


def test_mooncake_unreachable_is_fast_and_explicit():
    """No server listens on the port: get says unreachable, put raises; nothing waits ~90 s in setup."""
    from components.kvstore.servers import free_port

    port = free_port()
    s = open_store(
        f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{free_port()}/metadata&connect_timeout=1"
    )
    r = s.get("run/0/0")
    assert r.kv is None and r.code == "unreachable" and f"127.0.0.1:{port}" in r.reason
    assert not s.health().ok
    with pytest.raises(StoreError, match="unreachable"):
        s.put("run/0/0", make_kv())
