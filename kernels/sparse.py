"""Sparse codec: the k largest-magnitude values of every chunk, as int8 codes with one scale per chunk.

For the ``sparse`` compression (SparseLoCo-style: top-k per chunk, low-bit values, error feedback on
what was left out, kernels/error_feedback.py). Wire layout (little-endian, no header; ``numel``,
``chunk_size`` and ``k`` are known to both sides), with ``n`` chunks and ``k_c = min(k, len(chunk c))``
values kept in chunk ``c``::

    float32 scales[n] | int8 codes[sum k_c] | uint16 index[sum k_c]

Codes and indices are chunk after chunk; a chunk's indices are positions inside it, strictly increasing.

Encode, per chunk, in float32: keep the ``k_c`` values of largest magnitude (ties: the lower index,
so the choice is the same on every machine), in index order; ``scale = max |x| / 127`` (0 for an
all-zero chunk) and ``code = round(x / scale)`` (round-half-to-even) in [-127, 127].

Decode: ``y[c * chunk_size + index] = float32(code) * scale``, zero elsewhere: one correctly rounded
multiply, so every peer decodes the same bytes to bitwise-identical tensors. Encoding is deterministic
too (the k-th magnitude and an explicit tie rule, IEEE division), so a reducer and its auditor
re-encode the same fp32 vector to the same bytes.

A group's average of n such parts has up to n x k nonzeros per chunk: reducers encode it with
:func:`result_k` (``n x k`` slots), so the average loses nothing to the result's sparsity; only its
values are rounded once, as with int8.
"""

from __future__ import annotations

import sys

import torch

from .errors import CodecError

if sys.byteorder != "little":  # the wire format is the native layout of little-endian hosts
    raise ImportError("hivetrain.kernels.sparse needs a little-endian host")

SPARSE_CHUNK = 4096  # values per chunk (SparseLoCo's 64 x 64 blocks)
SPARSE_K = 64  # values kept per chunk: 1.56 %
MAX_INDEX_CHUNK = 1 << 16  # indices are uint16
MAX_ABS_VALUE = 1e38  # encode refuses inputs with |x| above this
MAX_ABS_SCALE = 1e36  # a valid scale is finite and in [0, MAX_ABS_SCALE]: 127 x scale stays finite
LEVELS = 127

Payload = bytes | bytearray | memoryview


def check_params(chunk_size: int, k: int) -> None:
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_INDEX_CHUNK:
        raise ValueError(f"sparse chunk_size must be an int in [1, {MAX_INDEX_CHUNK}], got {chunk_size!r}")
    if not isinstance(k, int) or not 1 <= k <= chunk_size:
        raise ValueError(f"sparse k must be an int in [1, chunk_size={chunk_size}], got {k!r}")


def kept(numel: int, chunk_size: int, k: int) -> tuple[int, int, int]:
    """(full chunks, values of the tail chunk (0: none), values kept in the tail chunk)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    full, tail = divmod(numel, chunk_size)
    return full, tail, min(k, tail)


def encoded_nbytes(numel: int, chunk_size: int = SPARSE_CHUNK, k: int = SPARSE_K) -> int:
    """Exact byte length of a sparse payload: 4 bytes per chunk and 3 per kept value."""
    check_params(chunk_size, k)
    full, tail, k_tail = kept(numel, chunk_size, k)
    values = full * k + k_tail
    return 4 * (full + (tail > 0)) + 3 * values


def result_k(k: int, members: int, chunk_size: int = SPARSE_CHUNK) -> int:
    """Slots per chunk of a reducer's result for a group of ``members``: room for every part's values."""
    return min(chunk_size, k * max(1, members))


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest |values| of each row of ``rows`` (r, w), ties to the lower index, in index
    order: (values (r, k) fp32, indices (r, k) int64). topk only gives the k-th largest magnitude
    (a value, the same however topk orders ties); the choice among equal magnitudes is made here."""
    r = rows.shape[0]
    mag = rows.abs()  # (r, w)
    top = mag.topk(k, dim=1, sorted=False).values  # (r, k)
    kth = top.amin(dim=1, keepdim=True)  # (r, 1)
    mask = mag >= kth  # (r, w): k values per row, or more where several equal the k-th
    hits = mask.nonzero()  # (m, 2) row-major
    ties = (torch.bincount(hits[:, 0], minlength=r) > k).nonzero()[:, 0]  # rows with too many (rare)
    if ties.numel():
        room = k - (top[ties] > kth[ties]).sum(dim=1, keepdim=True)  # values at the k-th magnitude to keep
        at = mag[ties] == kth[ties]
        mask[ties] = (mag[ties] > kth[ties]) | (at & (at.cumsum(dim=1) <= room))
        hits = mask.nonzero()
    index = hits[:, 1].view(r, k)  # ascending within each row
    return rows.gather(1, index), index


def encode(x: torch.Tensor, chunk_size: int = SPARSE_CHUNK, k: int = SPARSE_K) -> bytes:
    """Encode a 1-D float32 CPU tensor to ``encoded_nbytes(x.numel(), chunk_size, k)`` bytes.

    Raises ValueError if ``x`` is not 1-D float32 on CPU, or holds NaN, Inf or |x| > MAX_ABS_VALUE."""
    check_params(chunk_size, k)
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("expected a 1-D float32 CPU tensor")
    x = x.contiguous()
    if x.numel() and not bool((x.abs() <= MAX_ABS_VALUE).all()):  # NaN fails the comparison too
        raise ValueError(f"input has NaN, Inf or |x| > {MAX_ABS_VALUE:g}")
    full, tail, k_tail = kept(x.numel(), chunk_size, k)
    blocks = []  # (values (r, kc), indices (r, kc)) per block of chunks
    if full:
        blocks.append(_select(x[: full * chunk_size].view(full, chunk_size), k))
    if tail:
        blocks.append(_select(x[full * chunk_size :].view(1, tail), k_tail))
    scales, codes, indices = [], [], []
    for values, index in blocks:
        scale = values.abs().amax(dim=1) / float(LEVELS)  # (r,) fp32
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes.append((values / divisor[:, None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8).flatten())
        scales.append(scale)
        indices.append(index.to(torch.int32).flatten())
    if not blocks:
        return b""
    s = torch.cat(scales).numpy().astype("<f4").tobytes()
    c = torch.cat(codes).numpy().tobytes()
    i = torch.cat(indices).numpy().astype("<u2").tobytes()
    return s + c + i


def decode(payload: Payload, numel: int, chunk_size: int = SPARSE_CHUNK, k: int = SPARSE_K) -> torch.Tensor:
    """Decode a sparse payload of ``numel`` values into a new float32 tensor (numel,).

    Raises CodecError on a wrong length, a bad scale, a code of -128, or indices that are out of
    their chunk or not strictly increasing (no position is written twice)."""
    expected = encoded_nbytes(numel, chunk_size, k)
    try:
        buf = memoryview(payload).cast("B")
    except (TypeError, ValueError) as e:
        raise CodecError(f"payload is not a contiguous byte buffer: {e}") from None
    if len(buf) != expected:
        raise CodecError(f"sparse payload has {len(buf)} bytes, expected {expected} "
                         f"(numel={numel}, chunk_size={chunk_size}, k={k})")
    out = torch.zeros(numel, dtype=torch.float32)  # (numel,)
    if numel == 0:
        return out
    full, tail, k_tail = kept(numel, chunk_size, k)
    n = full + (tail > 0)
    values = full * k + k_tail
    raw = bytearray(buf)  # torch.frombuffer wants a writable buffer
    scales = torch.frombuffer(raw, dtype=torch.float32, count=n, offset=0).clone()  # (n,)
    codes = torch.frombuffer(raw, dtype=torch.int8, count=values, offset=4 * n).to(torch.float32)  # (values,)
    index = torch.frombuffer(raw, dtype=torch.int16, count=values, offset=4 * n + values).to(torch.int64) & 0xFFFF
    bad_scale = ~torch.isfinite(scales) | (scales < 0) | (scales > MAX_ABS_SCALE)
    if bool(bad_scale.any()):
        raise CodecError(f"sparse payload: bad scale in chunk {int(bad_scale.nonzero()[0, 0])} of {n}")
    if bool((codes == -128).any()):
        raise CodecError("sparse payload: code -128 (codes are in [-127, 127])")
    rows = [(index[: full * k].view(full, k), chunk_size)] if full else []
    if tail:
        rows.append((index[full * k :].view(1, k_tail), tail))
    for idx, width in rows:
        if bool((idx >= width).any()):
            raise CodecError(f"sparse payload: an index is outside its chunk of {width}")
        if idx.shape[1] > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise CodecError("sparse payload: a chunk's indices are not strictly increasing")
    chunk_of = torch.cat([torch.arange(full).repeat_interleave(k), torch.full((k_tail,), full)])  # (values,)
    positions = chunk_of * chunk_size + index
    out[positions] = codes * scales[chunk_of]  # one fp32 multiply per value
    return out
