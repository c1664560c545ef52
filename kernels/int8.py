"""Reference int8 codec with per-chunk min/max affine scales, plus a plain fp32 codec.

Wire layout of an int8 payload (little-endian, no header; ``numel`` and ``chunk_size`` are known to
both sides): ``float32 scales[n] | float32 offsets[n] | int8 codes[numel]`` with
``n = num_chunks(numel, chunk_size)``. Chunk ``c`` covers ``x[c*chunk_size : (c+1)*chunk_size]``;
the last chunk may be partial.

Encode, per chunk, all in float32 (``round`` is round-half-to-even)::

    lo, hi = min(chunk), max(chunk)
    scale  = (hi - lo) / 255                      # 0 when hi == lo (or the difference underflows)
    code   = clamp(round((x - lo) / (scale if scale > 0 else 1)), 0, 255) - 128   -> int8
    offset = lo

Decode, per element, as three separately rounded float32 ops (never fused into an FMA)::

    y = ((float32(code) + 128) * scale) + offset

``float32(code) + 128`` is exact, and IEEE-754 ``*`` and ``+`` are correctly rounded, so every CPU
peer decodes the same bytes to bitwise-identical tensors (as long as nobody enables
``torch.set_flush_denormal``). Encoding is deterministic too, but only decode must agree across peers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import CodecError

if sys.byteorder != "little":  # the wire format is the native layout of little-endian hosts
    raise ImportError("hivetrain.kernels.int8 needs a little-endian host")

CHUNK_SIZE: int = 65536
MAX_ABS_VALUE: float = 1e38  # encode refuses inputs with |x| above this
MAX_ABS_SCALE: float = 1e36  # a valid scale is finite and in [0, MAX_ABS_SCALE]
MAX_ABS_OFFSET: float = 1e38  # a valid offset is finite and |offset| <= MAX_ABS_OFFSET
MAX_DECODED: float = 3e38  # offset + 255*scale (float64) must stay below this: < FLT_MAX with margin
_BLOCK_ELEMS = 1 << 20  # process ~1M elements (4 MB) per block so temporaries stay in cache

Payload = bytes | bytearray | memoryview


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def num_chunks(numel: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Number of chunks (= scales = offsets) for ``numel`` elements; the last chunk may be partial."""
    _check_chunk_size(chunk_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // chunk_size)


def encoded_nbytes(numel: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Exact byte length of an int8 payload: 8 bytes per chunk plus 1 byte per element."""
    return 8 * num_chunks(numel, chunk_size) + numel


def _check_input(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` contiguous after checking it is a 1-D float32 CPU tensor."""
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("expected a 1-D float32 CPU tensor")
    return x.contiguous()


def _row_blocks(numel: int, chunk_size: int) -> Iterator[tuple[int, int, int]]:
    """Yield ``(first_chunk, n_rows, row_len)``: blocks of whole chunks, then the partial tail chunk."""
    n_full = numel // chunk_size
    rows = max(1, _BLOCK_ELEMS // chunk_size)
    for c in range(0, n_full, rows):
        yield c, min(rows, n_full - c), chunk_size
    if numel > n_full * chunk_size:
        yield n_full, 1, numel - n_full * chunk_size


def encode_reference(x: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> bytes:
    """Pure-torch reference of :func:`encode`: its bytes are the specification of the wire format."""
    x = _check_input(x)
    numel, n = x.numel(), num_chunks(x.numel(), chunk_size)
    buf = torch.empty(encoded_nbytes(numel, chunk_size), dtype=torch.uint8)
    scales = buf[: 4 * n].view(torch.float32)  # (n,) float32
    offsets = buf[4 * n : 8 * n].view(torch.float32)  # (n,) float32
    codes = buf[8 * n :].view(torch.int8)  # (numel,) int8
    scratch = torch.empty(min(numel, max(chunk_size, _BLOCK_ELEMS)), dtype=torch.float32)
    for c, r, w in _row_blocks(numel, chunk_size):
        s = c * chunk_size
        rows = x[s : s + r * w].view(r, w)  # (r, w) float32
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)  # (r,), (r,); NaN propagates (aminmax(dim) is slow)
        if not (bool((lo >= -MAX_ABS_VALUE).all()) and bool((hi <= MAX_ABS_VALUE).all())):
            raise ValueError(f"input has NaN, Inf or |x| > {MAX_ABS_VALUE:g} in chunks {c}..{c + r - 1}")
        scale = (hi - lo) / 255.0  # (r,) float32
        t = torch.sub(rows, lo[:, None], out=scratch[: r * w].view(r, w))  # (r, w) float32
        t.div_(torch.where(scale > 0, scale, torch.ones_like(scale))[:, None])
        t.round_().clamp_(0.0, 255.0).sub_(128.0)
        codes[s : s + r * w].view(r, w).copy_(t)  # exact: t holds integers in [-128, 127]
        scales[c : c + r] = scale
        offsets[c : c + r] = lo
    return buf.numpy().tobytes()


def _byte_view(payload: Payload) -> memoryview | bytearray:
    """A flat byte view torch.frombuffer accepts; read-only buffers are copied (frombuffer warns)."""
    try:
        mv = memoryview(payload).cast("B")
    except (TypeError, ValueError) as e:
        raise CodecError(f"payload is not a contiguous byte buffer: {e}") from None
    return bytearray(mv) if mv.readonly else mv


def _parse(payload: Payload, numel: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate an int8 payload fully; return ``(scales (n,), offsets (n,), codes (numel,) int8)``.

    scales and offsets are private copies; codes may alias ``payload`` and must be consumed at once.
    """
    expected = encoded_nbytes(numel, chunk_size)
    buf = _byte_view(payload)
    if len(buf) != expected:
        raise CodecError(f"int8 payload has {len(buf)} bytes, expected {expected} (numel={numel}, chunk_size={chunk_size})")
    n = num_chunks(numel, chunk_size)
    if numel == 0:
        empty = torch.empty(0, dtype=torch.float32)
        return empty, empty, torch.empty(0, dtype=torch.int8)
    scales = torch.frombuffer(buf, dtype=torch.float32, count=n, offset=0).clone()  # (n,) float32
    offsets = torch.frombuffer(buf, dtype=torch.float32, count=n, offset=4 * n).clone()  # (n,) float32
    codes = torch.frombuffer(buf, dtype=torch.int8, count=numel, offset=8 * n)  # (numel,) int8
    for bad, what in scale_checks(scales, offsets):
        if bool(bad.any()):
            raise CodecError(f"int8 payload: {what} in chunk {int(bad.nonzero()[0, 0])} of {n}")
    return scales, offsets, codes


def scale_checks(scales: torch.Tensor, offsets: torch.Tensor) -> tuple[tuple[torch.Tensor, str], ...]:
    """The per-chunk validity rules of a payload, as (bad mask (n,), what) pairs: one definition for
    the reference, the C path and the Triton path."""
    return (
        (~torch.isfinite(scales), "non-finite scale"),
        (scales < 0, "negative scale"),
        (scales > MAX_ABS_SCALE, f"scale above {MAX_ABS_SCALE:g}"),
        (~torch.isfinite(offsets), "non-finite offset"),
        (offsets.abs() > MAX_ABS_OFFSET, f"|offset| above {MAX_ABS_OFFSET:g}"),
        (offsets.double() + 255.0 * scales.double() > MAX_DECODED, "decoded values would overflow float32"),
    )


def _check_acc(acc: torch.Tensor, numel: int, weight: float) -> None:
    if not isinstance(acc, torch.Tensor) or acc.shape != (numel,) or acc.dtype != torch.float32:
        raise ValueError(f"acc must be a float32 tensor of shape ({numel},)")
    if acc.device.type != "cpu" or not acc.is_contiguous():
        raise ValueError("acc must be a contiguous CPU tensor")
    if not math.isfinite(weight):
        raise ValueError(f"weight must be finite, got {weight}")


def _dequantize(
    payload: Payload, numel: int, chunk_size: int, out: torch.Tensor, accumulate: bool, weight: float
) -> None:
    """Validate, then write (``accumulate=False``) or add ``weight * decoded`` into ``out`` (numel,)."""
    scales, offsets, codes = _parse(payload, numel, chunk_size)
    tmp = torch.empty(min(numel, max(chunk_size, _BLOCK_ELEMS)), dtype=torch.float32) if accumulate else out
    for c, r, w in _row_blocks(numel, chunk_size):
        s = c * chunk_size
        dst = tmp[: r * w] if accumulate else out[s : s + r * w]
        d = dst.view(r, w)  # (r, w) float32
        d.copy_(codes[s : s + r * w].view(r, w)).add_(128.0)  # exact: integers in [0, 255]
        d.mul_(scales[c : c + r, None]).add_(offsets[c : c + r, None])
        if accumulate:
            if weight != 1.0:
                dst.mul_(weight)
            out[s : s + r * w].add_(dst)  # separate mul and add: no FMA, same result on every CPU


def decode_reference(payload: Payload, numel: int, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Pure-torch reference of :func:`decode` (same contract, bitwise the same values)."""
    out = torch.empty(numel, dtype=torch.float32)  # (numel,) float32
    _dequantize(payload, numel, chunk_size, out, accumulate=False, weight=1.0)
    return out


def decode_accumulate_reference(
    payload: Payload, numel: int, acc: torch.Tensor, weight: float = 1.0, chunk_size: int = CHUNK_SIZE
) -> None:
    """Pure-torch reference of :func:`decode_accumulate` (same contract, bitwise the same values)."""
    _check_acc(acc, numel, float(weight))
    _dequantize(payload, numel, chunk_size, acc, accumulate=True, weight=float(weight))


# Public entry points: the fast kernel when ACTIVE_PATH says so (see the end of this module), else the
# reference above. Both give the same bytes and the same float32 values.


def encode(x: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> bytes:
    """Encode a 1-D float32 CPU tensor to ``encoded_nbytes(x.numel(), chunk_size)`` bytes.

    Raises ValueError if ``x`` is not 1-D float32 on CPU, or holds NaN, Inf or |x| > MAX_ABS_VALUE.
    """
    if active_path() == _fast_cpu.NAME:
        return _fast_cpu.encode(x, chunk_size)
    return encode_reference(x, chunk_size)


def decode(payload: Payload, numel: int, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Decode an int8 payload of ``numel`` elements into a new float32 tensor (numel,).

    Raises CodecError on a wrong length or bad scales/offsets (see MAX_* bounds). Within those bounds
    every decoded value is finite. The result never aliases ``payload``.
    """
    if active_path() == _fast_cpu.NAME:
        return _fast_cpu.decode(payload, numel, chunk_size)
    return decode_reference(payload, numel, chunk_size)


def decode_accumulate(
    payload: Payload, numel: int, acc: torch.Tensor, weight: float = 1.0, chunk_size: int = CHUNK_SIZE
) -> None:
    """``acc += weight * decode(payload)`` in float32 (product rounded, then added).

    The payload is validated completely before ``acc`` is touched: on CodecError ``acc`` is unchanged.
    """
    if active_path() == _fast_cpu.NAME:
        _fast_cpu.decode_accumulate(payload, numel, acc, weight, chunk_size)
    else:
        decode_accumulate_reference(payload, numel, acc, weight, chunk_size)


def quantize_roundtrip(x: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """``decode(encode(x))``: what peers see of ``x`` after one int8 trip."""
    return decode(encode(x, chunk_size), x.numel(), chunk_size)


def encoded_nbytes_fp32(numel: int) -> int:
    """Exact byte length of an fp32 payload: 4 bytes per element."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return 4 * numel


def encode_fp32(x: torch.Tensor) -> bytes:
    """Raw little-endian float32 bytes of a 1-D float32 CPU tensor; ValueError on NaN/Inf."""
    x = _check_input(x)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("input has NaN or Inf")
    return x.numpy().tobytes()


def decode_fp32(payload: Payload, numel: int) -> torch.Tensor:
    """Decode an fp32 payload into a new float32 tensor (numel,); CodecError on bad length or NaN/Inf."""
    buf = _byte_view(payload)
    if len(buf) != encoded_nbytes_fp32(numel):
        raise CodecError(f"fp32 payload has {len(buf)} bytes, expected {encoded_nbytes_fp32(numel)}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    out = torch.frombuffer(buf, dtype=torch.float32, count=numel).clone()  # (numel,) float32
    if not bool(torch.isfinite(out).all()):
        raise CodecError("fp32 payload holds NaN or Inf")
    return out


def decode_accumulate_fp32(payload: Payload, numel: int, acc: torch.Tensor, weight: float = 1.0) -> None:
    """``acc += weight * decode_fp32(payload)``; on CodecError ``acc`` is unchanged."""
    _check_acc(acc, numel, float(weight))
    tmp = decode_fp32(payload, numel)
    if weight != 1.0:
        tmp.mul_(float(weight))
    acc.add_(tmp)


@dataclass(frozen=True)
class Codec:
    """A wire codec chosen by name (``"int8"``, ``"fp32"`` or ``"sparse"``); build it with :func:`get_codec`.

    ``k``: values kept per chunk (sparse only, kernels/sparse.py; 0 otherwise)."""

    name: str
    chunk_size: int = CHUNK_SIZE
    k: int = 0

    def encoded_nbytes(self, numel: int) -> int:
        if self.name == "int8":
            return encoded_nbytes(numel, self.chunk_size)
        if self.name == "sparse":
            return _sparse.encoded_nbytes(numel, self.chunk_size, self.k)
        return encoded_nbytes_fp32(numel)

    def encode(self, x: torch.Tensor) -> bytes:
        if self.name == "int8":
            return encode(x, self.chunk_size)
        if self.name == "sparse":
            return _sparse.encode(x, self.chunk_size, self.k)
        return encode_fp32(x)

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        if self.name == "int8":
            return decode(payload, numel, self.chunk_size)
        if self.name == "sparse":
            return _sparse.decode(payload, numel, self.chunk_size, self.k)
        return decode_fp32(payload, numel)

    def decode_accumulate(self, payload: Payload, numel: int, acc: torch.Tensor, weight: float = 1.0) -> None:
        if self.name == "int8":
            decode_accumulate(payload, numel, acc, weight, self.chunk_size)
        elif self.name == "sparse":
            _check_acc(acc, numel, float(weight))
            acc.add_(_sparse.decode(payload, numel, self.chunk_size, self.k).mul_(float(weight)))
        else:
            decode_accumulate_fp32(payload, numel, acc, weight)

    def for_results(self, members: int) -> Codec:
        """The codec a reducer encodes a group's combination with: this one, except for sparse, whose
        average of ``members`` parts has up to ``members`` x k values per chunk: a sparse codec with
        that many slots while it is smaller than int8's byte per value, else dense int8."""
        if self.name != "sparse":
            return self
        k = _sparse.result_k(self.k, members, self.chunk_size)
        if _sparse.encoded_nbytes(self.chunk_size, self.chunk_size, k) < self.chunk_size:  # a chunk: below a byte a value
            return Codec("sparse", self.chunk_size, k)
        return Codec("int8", CHUNK_SIZE)


def get_codec(name: str, chunk_size: int | None = None, k: int | None = None) -> Codec:
    """The codec called ``name``; CodecError for any other name or a bad size (there is no silent fallback).

    ``chunk_size``: values per scale (default: int8's CHUNK_SIZE, sparse's SPARSE_CHUNK); ``k``: values
    kept per chunk, sparse only (default SPARSE_K)."""
    if name not in ("int8", "fp32", "sparse"):
        raise CodecError(f"unknown codec {name!r}; expected 'int8', 'fp32' or 'sparse'")
    if name == "sparse":
        chunk_size = _sparse.SPARSE_CHUNK if chunk_size is None else chunk_size
        k = _sparse.SPARSE_K if k is None else k
        try:
            _sparse.check_params(chunk_size, k)
        except ValueError as e:
            raise CodecError(str(e)) from None
        return Codec(name, chunk_size, k)
    if k:
        raise CodecError(f"k is for the sparse codec, not {name}")
    chunk_size = CHUNK_SIZE if chunk_size is None else chunk_size
    _check_chunk_size(chunk_size)
    return Codec(name, chunk_size)


# Imported last: fast_cpu uses the helpers above (its self-test compares against the references).
from . import fast_cpu as _fast_cpu  # noqa: E402
from . import sparse as _sparse  # noqa: E402

ACTIVE_PATH: str | None = None
"""Which implementation ``encode``/``decode``/``decode_accumulate`` use: ``"c"`` (the compiled kernel of
:mod:`hivetrain.kernels.fast_cpu`) or ``"reference"`` (pure torch; a warning was logged saying why,
and ``fast_cpu.UNAVAILABLE_REASON`` holds it). Both produce the same bytes and values. None until the
first call of :func:`active_path` (nothing is compiled at import time)."""


def active_path() -> str:
    """Builds or loads the fast kernel on first use; returns ``ACTIVE_PATH``."""
    global ACTIVE_PATH
    if ACTIVE_PATH is None:
        ACTIVE_PATH = _fast_cpu.NAME if _fast_cpu.load() else "reference"
    return ACTIVE_PATH
