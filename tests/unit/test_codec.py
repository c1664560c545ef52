"""Unit tests of hivetrain.kernels.int8: error bounds, wire layout, validation, determinism."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import (
    CHUNK_SIZE,
    Codec,
    decode,
    decode_accumulate,
    decode_accumulate_fp32,
    decode_fp32,
    encode,
    encode_fp32,
    encoded_nbytes,
    encoded_nbytes_fp32,
    get_codec,
    num_chunks,
    quantize_roundtrip,
)


def _gauss(n: int, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * std


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _numpy_decode(payload: bytes, numel: int, chunk_size: int) -> np.ndarray:
    """Independent decode in numpy, following the documented op order."""
    n = num_chunks(numel, chunk_size)
    scales = np.frombuffer(payload, "<f4", n, 0)
    offsets = np.frombuffer(payload, "<f4", n, 4 * n)
    codes = np.frombuffer(payload, np.int8, numel, 8 * n)
    idx = np.arange(numel) // chunk_size
    return (codes.astype(np.float32) + np.float32(128)) * scales[idx] + offsets[idx]


@pytest.mark.parametrize("numel, chunk", [(1, 1000), (999, 1000), (1000, 1000), (3000, 1000), (3500, 1000),
                                          (CHUNK_SIZE * 3 + 1234, CHUNK_SIZE), (CHUNK_SIZE * 2, CHUNK_SIZE)])
def test_roundtrip_error_bound_and_layout(numel: int, chunk: int) -> None:
    x = _gauss(numel, seed=numel)
    payload = encode(x, chunk)
    assert len(payload) == encoded_nbytes(numel, chunk) == 8 * num_chunks(numel, chunk) + numel
    y = decode(payload, numel, chunk)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    assert np.array_equal(y.numpy(), _numpy_decode(payload, numel, chunk))  # bitwise, independent impl
    n = num_chunks(numel, chunk)
    scales = torch.frombuffer(bytearray(payload[: 4 * n]), dtype=torch.float32)
    for c in range(n):
        xs, ys = x[c * chunk : (c + 1) * chunk], y[c * chunk : (c + 1) * chunk]
        tol = float(scales[c]) / 2 * (1 + 1e-5) + 1e-6 * float(xs.abs().max())
        assert float((xs - ys).abs().max()) <= tol
        assert float(ys.min()) == float(xs.min())  # the chunk minimum is the offset: exact
    if numel >= 1000:
        assert _rel_l2(y, x) < 0.02


def test_student_t_relative_error() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        x = torch.distributions.StudentT(3.0).sample((1 << 20,)).float()
    err = _rel_l2(quantize_roundtrip(x), x)
    assert err < 0.10, err


def test_constant_chunks_are_exact() -> None:
    x = torch.cat([torch.full((1000,), 3.25), _gauss(1000), torch.full((500,), -7.0)])
    y = quantize_roundtrip(x, 1000)
    assert torch.equal(y[:1000], x[:1000]) and torch.equal(y[2000:], x[2000:])
    payload = encode(x, 1000)
    assert struct.unpack_from("<3f", payload, 0)[0] == 0.0 and struct.unpack_from("<3f", payload, 0)[2] == 0.0
    assert torch.equal(quantize_roundtrip(torch.zeros(70000)), torch.zeros(70000))


def test_extreme_and_tiny_ranges_decode_finite() -> None:
    x = torch.tensor([-1e38, 1e38, 0.0, 5e37])
    y = quantize_roundtrip(x)
    assert bool(torch.isfinite(y).all()) and _rel_l2(y, x) < 0.01
    t = torch.tensor([1e-45, 2e-45, 0.0])  # range underflows the scale
    assert float((quantize_roundtrip(t) - t).abs().max()) <= 3e-45
    assert encode(torch.empty(0)) == b"" and decode(b"", 0).shape == (0,)


def test_size_ratio_vs_fp32() -> None:
    x = _gauss(1_000_000)
    assert len(encode(x)) == encoded_nbytes(x.numel())
    assert len(encode(x)) / len(encode_fp32(x)) < 0.26
    assert encoded_nbytes_fp32(10) == 40


def test_determinism_and_buffer_types() -> None:
    x = _gauss(200_000, seed=7)
    p = encode(x)
    assert encode(x) == p and encode(x.clone()) == p
    ba = bytearray(p)
    y = decode(ba, x.numel())
    for buf in (memoryview(p), memoryview(ba), np.frombuffer(p, np.uint8)):
        assert torch.equal(decode(buf, x.numel()), y)
    ba[-1] ^= 0x7F
    ba[0:4] = struct.pack("<f", 5.0)  # mutating the source afterwards must not change the result
    assert torch.equal(decode(p, x.numel()), y)
    ba += b"\0"  # no buffer export of ``ba`` outlives decode (resizing would raise BufferError)


def test_simulated_peers_reduce_identical_everywhere() -> None:
    n, peers = 300_000, 4
    common = _gauss(n, seed=100)
    grads = [common + _gauss(n, seed=i) for i in range(peers)]  # correlated pseudo-gradients
    acc = torch.zeros(n)
    for g in grads:  # fixed order, fp32
        decode_accumulate(encode(g), n, acc)
    acc /= peers
    reduced = encode(acc)  # re-encoded once by the reducer
    members = [decode(reduced, n), decode(bytearray(reduced), n), decode(memoryview(reduced), n)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        members.append(decode(reduced, n))
    finally:
        torch.set_num_threads(old)
    members.append(torch.from_numpy(_numpy_decode(reduced, n, CHUNK_SIZE)))
    assert all(torch.equal(m, members[0]) for m in members)
    assert _rel_l2(members[0], torch.stack(grads).mean(0)) < 0.03


def test_decode_accumulate_weight_matches_decode() -> None:
    x = _gauss(100_000, seed=1)
    p = encode(x)
    acc0 = _gauss(100_000, seed=2)
    acc = acc0.clone()
    decode_accumulate(p, x.numel(), acc, weight=0.25)
    assert torch.equal(acc, acc0 + decode(p, x.numel()) * 0.25)


def _corrupt(numel: int, where: str, value: float) -> bytearray:
    buf = bytearray(encode(_gauss(numel), 1000))
    n = num_chunks(numel, 1000)
    struct.pack_into("<f", buf, (0 if where == "scale" else 4 * n) + 4 * (n - 1), value)
    return buf


def _overflow_payload() -> bytearray:
    buf = _corrupt(2500, "scale", 1e36)
    struct.pack_into("<f", buf, 4 * 3 + 4 * 2, 9e37)  # chunk 2: 9e37 + 255 * 1e36 > MAX_DECODED
    return buf


BAD_PAYLOADS = {
    "short": lambda: encode(_gauss(2500), 1000)[:-1],
    "long": lambda: encode(_gauss(2500), 1000) + b"\0",
    "empty": lambda: b"",
    "nan scale": lambda: _corrupt(2500, "scale", math.nan),
    "inf scale": lambda: _corrupt(2500, "scale", math.inf),
    "negative scale": lambda: _corrupt(2500, "scale", -1.0),
    "huge scale": lambda: _corrupt(2500, "scale", 1e38),
    "inf offset": lambda: _corrupt(2500, "offset", math.inf),
    "nan offset": lambda: _corrupt(2500, "offset", math.nan),
    "huge offset": lambda: _corrupt(2500, "offset", -3e38),
    "overflow": _overflow_payload,
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_bad_payload_raises_and_leaves_acc_untouched(case: str) -> None:
    payload = BAD_PAYLOADS[case]()
    with pytest.raises(CodecError):
        decode(payload, 2500, 1000)
    acc = _gauss(2500, seed=9)
    before = acc.clone()
    with pytest.raises(CodecError):
        decode_accumulate(payload, 2500, acc, 1.0, 1000)
    assert torch.equal(acc, before)


@pytest.mark.parametrize("bad", [
    torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0]), torch.tensor([-math.inf]),
    torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64), torch.zeros((), dtype=torch.float32),
])
def test_encode_rejects_bad_input(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        encode(bad)
    with pytest.raises(ValueError):
        encode_fp32(bad)
    with pytest.raises(ValueError, match="MAX|1e"):
        encode(torch.tensor([0.0, 3e38]))  # beyond MAX_ABS_VALUE: int8 only


@pytest.mark.parametrize("pos", [0, 31, 12345, CHUNK_SIZE - 1, CHUNK_SIZE, 99_999])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_encode_rejects_non_finite_anywhere(pos: int, value: float) -> None:
    x = _gauss(100_000)
    x[pos] = value
    with pytest.raises(ValueError):
        encode(x)


def test_fp32_codec_and_get_codec() -> None:
    x = _gauss(1234)
    p = encode_fp32(x)
    assert len(p) == encoded_nbytes_fp32(1234) and torch.equal(decode_fp32(p, 1234), x)
    acc = torch.ones(1234)
    decode_accumulate_fp32(p, 1234, acc, 2.0)
    assert torch.equal(acc, 1.0 + x * 2.0)
    bad = bytearray(p)
    struct.pack_into("<f", bad, 8, math.nan)
    for payload in (bad, p[:-4]):
        with pytest.raises(CodecError):
            decode_fp32(payload, 1234)
        with pytest.raises(CodecError):
            decode_accumulate_fp32(payload, 1234, acc)
    assert torch.equal(acc, 1.0 + x * 2.0)
    for name in ("int8", "fp32"):
        codec = get_codec(name, 1000)
        assert isinstance(codec, Codec) and codec.name == name
        q = codec.encode(x)
        assert len(q) == codec.encoded_nbytes(1234)
        acc = torch.zeros(1234)
        codec.decode_accumulate(q, 1234, acc)
        assert torch.equal(acc, codec.decode(q, 1234))
    assert get_codec("int8", 1000).encode(x) == encode(x, 1000)
    for name in ("int4", "", "INT8"):
        with pytest.raises(CodecError):
            get_codec(name)
