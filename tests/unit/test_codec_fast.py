"""The fast int8 codec paths (compiled C on CPU, Triton on CUDA) against the pure-torch reference, bitwise."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hivetrain.kernels import fast_cpu
from hivetrain.kernels import int8 as codec
from hivetrain.kernels.errors import CodecError

CS = codec.CHUNK_SIZE
HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_fast = pytest.mark.skipif(not fast_cpu.available(), reason=f"fast CPU kernel unavailable: {fast_cpu.UNAVAILABLE_REASON}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    if kind == "gauss":
        return torch.randn(n, generator=g)
    if kind == "t3":  # heavy tails: Student-t(3) = N / sqrt(chi2_3 / 3)
        z, c = torch.randn(n, generator=g), torch.randn(3, n, generator=g).pow(2).sum(0)
        return (z / (c / 3).sqrt()).float()
    if kind == "mixed":  # flat buffer of "layers" whose scales span 1e-3..1
        scale = torch.logspace(-3, 0, 37)[torch.arange(n) * 37 // max(n, 1)]
        return torch.randn(n, generator=g) * scale
    if kind == "constant":
        return torch.full((n,), -2.75)
    if kind == "signed_zeros":  # chunks whose min/max is a zero of either sign
        x = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0)
        k = torch.arange(n) // 1000
        return torch.where(k % 3 == 1, x.abs() + torch.rand(n, generator=g), torch.where(k % 3 == 2, x - torch.rand(n, generator=g), x))
    if kind == "extreme":
        return torch.tensor([-1e38, 1e38, 0.0, 5e37, 1e-45, -3e-45])[torch.arange(n) % 6]
    if kind == "tiny":  # ranges that underflow the scale or make it denormal
        return (torch.randint(-300, 300, (n,), generator=g).float() * 1e-45).float()
    raise ValueError(kind)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # bitwise comparison: torch.equal alone takes -0.0 == +0.0


def _assert_same(x: torch.Tensor, chunk: int, weights: tuple[float, ...] = (1.0, 0.3, -1.7, 0.0)) -> None:
    ref = codec.encode_reference(x, chunk)
    fast = fast_cpu.encode(x, chunk)
    assert isinstance(fast, bytes) and fast == ref
    numel = x.numel()
    assert torch.equal(_bits(fast_cpu.decode(ref, numel, chunk)), _bits(codec.decode_reference(ref, numel, chunk)))
    for w in weights:
        a = torch.randn(numel, generator=_gen(numel))
        b = a.clone()
        fast_cpu.decode_accumulate(ref, numel, a, w, chunk)
        codec.decode_accumulate_reference(ref, numel, b, w, chunk)
        assert torch.equal(_bits(a), _bits(b)), w


def test_active_path_is_reported_and_used() -> None:
    if HAS_CC:  # a compiler is present, so a missing fast path is a bug, not a fallback
        assert fast_cpu.available(), fast_cpu.UNAVAILABLE_REASON
        assert codec.active_path() == fast_cpu.NAME == "c" and fast_cpu.UNAVAILABLE_REASON is None
    else:
        assert codec.active_path() == "reference" and fast_cpu.UNAVAILABLE_REASON


@needs_fast
def test_public_functions_route_to_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference was called")

    x = _data("gauss", 3000)
    expected = codec.encode_reference(x, 1000)
    for name in ("encode_reference", "decode_reference", "decode_accumulate_reference"):
        monkeypatch.setattr(codec, name, boom)
    assert codec.encode(x, 1000) == expected == codec.get_codec("int8", 1000).encode(x)
    codec.decode(expected, 3000, 1000)
    codec.decode_accumulate(expected, 3000, torch.zeros(3000), 0.5, 1000)


@needs_fast
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, CS - 1, CS, CS + 1, 3 * CS + 5])
@pytest.mark.parametrize("kind", ["gauss", "t3", "constant", "signed_zeros", "extreme"])
def test_fast_equals_reference_default_chunk(numel: int, kind: str) -> None:
    _assert_same(_data(kind, numel, seed=numel), CS)


@needs_fast
@pytest.mark.parametrize("kind", ["gauss", "t3", "mixed", "constant", "signed_zeros", "extreme", "tiny"])
@pytest.mark.parametrize("chunk", [1, 7, 1000, 4099])
def test_fast_equals_reference_odd_chunks(kind: str, chunk: int) -> None:
    _assert_same(_data(kind, 20_011, seed=chunk), chunk)


@needs_fast
def test_mixed_constant_and_zero_chunks() -> None:
    x = torch.cat([torch.full((CS,), 3.25), torch.zeros(CS), -torch.zeros(CS), _data("gauss", CS), torch.full((5,), -7.0)])
    _assert_same(x, CS)
    y = codec.decode(codec.encode(x), x.numel())
    assert torch.equal(y[:CS], x[:CS]) and torch.equal(y[-5:], x[-5:])


@needs_fast
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_and_streaming_paths(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Split work over threads and use non-temporal stores at small sizes: the bytes must not change."""
    monkeypatch.setattr(fast_cpu, "MIN_NUMEL_PER_THREAD", 1)
    monkeypatch.setattr(fast_cpu, "NT_MIN_NUMEL", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind, chunk, numel in [("gauss", CS, 5 * CS + 77), ("signed_zeros", 1000, 10_007), ("t3", 4099, 50_000)]:
            _assert_same(_data(kind, numel, seed=threads), chunk, weights=(1.0, 0.25))
    finally:
        torch.set_num_threads(old)


@needs_fast
def test_preallocated_variants_and_buffer_types() -> None:
    x = _data("mixed", 2 * CS + 3)
    ref = codec.encode_reference(x)
    out = torch.full((len(ref),), 7, dtype=torch.uint8)
    assert fast_cpu.encode_into(x, out) is out and bytes(out.numpy()) == ref
    dec = torch.empty(x.numel())
    expected = codec.decode_reference(ref, x.numel())
    for buf in (ref, bytearray(ref), memoryview(ref), np.frombuffer(ref, np.uint8), out.numpy()):
        assert torch.equal(_bits(fast_cpu.decode_into(buf, x.numel(), dec)), _bits(expected))
    with pytest.raises(ValueError):
        fast_cpu.encode_into(x, torch.empty(len(ref) - 1, dtype=torch.uint8))
    assert fast_cpu.encode(torch.empty(0)) == b"" and fast_cpu.decode(b"", 0).shape == (0,)


def _bad_payloads() -> dict[str, bytes]:
    good = codec.encode_reference(_data("gauss", 2500), 1000)

    def put(*edits: tuple[int, float]) -> bytes:  # (byte offset, float32 value); n = 3 chunks
        b = bytearray(good)
        for offset, value in edits:
            struct.pack_into("<f", b, offset, value)
        return bytes(b)

    return {
        "short": good[:-1], "long": good + b"\0", "empty": b"",
        "nan scale": put((8, math.nan)), "negative scale": put((4, -1.0)), "huge scale": put((0, 1e37)),
        "inf offset": put((20, math.inf)), "huge offset": put((12, -3e38)),
        "overflow": put((8, 1e36), (20, 9e37)),  # chunk 2: 9e37 + 255 * 1e36 > MAX_DECODED
    }


@needs_fast
@pytest.mark.parametrize("case", sorted(_bad_payloads()))
def test_bad_payload_same_error_and_acc_untouched(case: str) -> None:
    payload = _bad_payloads()[case]
    with pytest.raises(CodecError) as ref_err:
        codec.decode_reference(payload, 2500, 1000)
    with pytest.raises(CodecError) as fast_err:
        fast_cpu.decode(payload, 2500, 1000)
    assert str(fast_err.value) == str(ref_err.value)
    acc = _data("gauss", 2500, seed=9)
    before = acc.clone()
    with pytest.raises(CodecError):
        fast_cpu.decode_accumulate(payload, 2500, acc, 1.0, 1000)
    assert torch.equal(acc, before)


@needs_fast
@pytest.mark.parametrize("pos", [0, 999, 1000, 2499])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1.0000001e38, -2e38])
def test_bad_input_raises_like_reference(pos: int, value: float) -> None:
    x = _data("gauss", 2500)
    x[pos] = value
    with pytest.raises(ValueError):
        codec.encode_reference(x, 1000)
    with pytest.raises(ValueError, match="NaN, Inf or"):
        fast_cpu.encode(x, 1000)
    x[pos] = 1e38  # exactly the limit is accepted by both
    assert fast_cpu.encode(x, 1000) == codec.encode_reference(x, 1000)
    for bad in (torch.zeros(2, 3), torch.zeros(3, dtype=torch.float64)):
        with pytest.raises(ValueError):
            fast_cpu.encode(bad)


def test_unavailable_kernel_warns_once_and_reports(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No silent downgrade: a failed build leaves a reason, one warning, and the reference answering."""
    def no_compiler(out_dir: object) -> None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")

    monkeypatch.setattr(fast_cpu, "_compile", no_compiler)
    monkeypatch.setattr(fast_cpu, "_loaded", False)
    monkeypatch.setattr(fast_cpu, "_lib", None)
    monkeypatch.setattr(fast_cpu, "UNAVAILABLE_REASON", None)
    with caplog.at_level(logging.WARNING, logger=fast_cpu.__name__):
        assert not fast_cpu.load() and not fast_cpu.load()
    assert "no C compiler" in (fast_cpu.UNAVAILABLE_REASON or "")
    assert sum("fast C path unavailable" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="unavailable"):
        fast_cpu.encode(torch.zeros(3))
    monkeypatch.setattr(codec, "ACTIVE_PATH", "reference")
    x = _data("gauss", 100)
    assert codec.encode(x) == codec.encode_reference(x)


# --- Triton (CUDA) --------------------------------------------------------------------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_logic_in_interpreter() -> None:
    """TRITON_INTERPRET=1 runs the kernels with numpy on CPU tensors (slowly): small sizes only."""
    script = textwrap.dedent(
        """
        import torch
        from hivetrain.kernels import int8 as R, triton_int8 as TI
        g = torch.Generator().manual_seed(0)
        for chunk, x in [(64, torch.cat([torch.randn(200, generator=g), torch.zeros(64), -torch.zeros(64),
                                       torch.tensor([0.0, -0.0, 1.0]).repeat(30), torch.full((70,), 2.5),
                                       torch.tensor([-1e38, 1e38, 1e-45, -2e-45]).repeat(16)])),
                         (R.CHUNK_SIZE, torch.randn(5000, generator=g))]:
            ref = R.encode_reference(x, chunk)
            p = TI.encode(x, chunk)
            assert bytes(p.numpy()) == ref
            bits = lambda t: t.view(torch.int32)
            assert torch.equal(bits(TI.decode(p, x.numel(), chunk)), bits(R.decode_reference(ref, x.numel(), chunk)))
            for w in (1.0, 0.3):
                a = torch.randn(x.numel(), generator=g); b = a.clone()
                TI.decode_accumulate(p, x.numel(), a, w, chunk)
                R.decode_accumulate_reference(ref, x.numel(), b, w, chunk)
                assert torch.equal(bits(a), bits(b))
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("numel", [1, CS - 1, CS, CS + 1, 3 * CS + 5, 10_000_019])
@pytest.mark.parametrize("kind", ["gauss", "t3", "mixed", "signed_zeros", "extreme", "tiny"])
def test_triton_equals_reference(numel: int, kind: str) -> None:
    from hivetrain.kernels import triton_int8

    x = _data(kind, numel, seed=numel)
    ref = codec.encode_reference(x)
    p = triton_int8.encode(x.cuda())
    assert bytes(p.cpu().numpy()) == ref
    assert torch.equal(_bits(triton_int8.decode(p, numel).cpu()), _bits(codec.decode_reference(ref, numel)))
    for w in (1.0, 0.3):
        acc = torch.randn(numel, generator=_gen(1))
        expected = acc.clone()
        codec.decode_accumulate_reference(ref, numel, expected, w)
        acc_gpu = acc.cuda()
        triton_int8.decode_accumulate(p, numel, acc_gpu, w)
        assert torch.equal(_bits(acc_gpu.cpu()), _bits(expected))


@pytest.mark.gpu
@gpu
def test_triton_rejects_bad_input_and_payload() -> None:
    from hivetrain.kernels import triton_int8

    x = _data("gauss", 2500).cuda()
    x[1500] = math.nan
    with pytest.raises(ValueError):
        triton_int8.encode(x, 1000)
    for case, payload in _bad_payloads().items():
        if len(payload) != codec.encoded_nbytes(2500, 1000):
            continue
        acc = torch.zeros(2500, device="cuda")
        with pytest.raises(CodecError):
            triton_int8.decode_accumulate(torch.frombuffer(bytearray(payload), dtype=torch.uint8).cuda(), 2500, acc, 1.0, 1000)
        assert not bool(acc.any()), case
