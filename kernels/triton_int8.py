"""CUDA (Triton) kernels of the int8 codec: encode and dequantize(-accumulate), bitwise equal to the reference.

Same wire layout and float32 op order as :mod:`hivetrain.kernels.int8` (``float32 scales[n] | float32
offsets[n] | int8 codes[numel]``), for CUDA tensors: the payload is a CUDA uint8 tensor, so a GPU peer
encodes and reduces without a host round trip. Import needs ``triton``; nothing here runs on CPU
except under ``TRITON_INTERPRET=1`` (Triton's numpy interpreter, used by the tests to check the logic).

How bit-exactness is kept on a GPU:

* the division is ``tl.math.div_rn`` (IEEE round-to-nearest); Triton's ``/`` is not (``div.full.f32``);
* round half to even is done as ``(q + 2**23) - 2**23`` on the clamped quotient ``q`` in [0, 255]:
  exact in float32, no libdevice call (``rint`` in libdevice may flush denormals);
* kernels are launched with ``enable_fp_fusion=False`` so ``a * b + c`` is never contracted to an FMA;
* the chunk min/max is a reduction over integer keys of the float bits (exact and order-free); where a
  chunk's min or max is a zero, the sign of that zero is taken from the reference's own CPU reduction
  (the codes do not depend on it), as in :mod:`hivetrain.kernels.fast_cpu`.

Each public function synchronises once with the host to raise on bad input (like the CPU path).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import int8 as ref
from .errors import CodecError

_MAX_ABS_BITS = 0x7E967699  # bit pattern of float32(1e38)
_BLOCK = 4096  # elements per tile; a chunk is covered by a loop of tiles


@triton.jit
def _key(b):
    """Sign-magnitude float bits -> int32 key with the same order (its own inverse)."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _encode_kernel(x_ptr, scales_ptr, offsets_ptr, his_ptr, bad_ptr, codes_ptr, numel, chunk,
                   BLOCK: tl.constexpr):
    c = tl.program_id(0)
    start = c.to(tl.int64) * chunk
    length = tl.minimum(numel - start, chunk)
    offs = tl.arange(0, BLOCK)
    mn = tl.full((BLOCK,), 2147483647, tl.int32)
    mx = tl.full((BLOCK,), -2147483648, tl.int32)
    am = tl.zeros((BLOCK,), tl.int32)
    for t in range(0, length, BLOCK):
        m = t + offs < length
        b = tl.load(x_ptr + start + t + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
        k = _key(b)
        mn = tl.where(m, tl.minimum(mn, k), mn)
        mx = tl.where(m, tl.maximum(mx, k), mx)
        am = tl.maximum(am, b & 0x7FFFFFFF)  # masked lanes load 0.0: harmless
    kmin = tl.min(mn, axis=0)
    kmax = tl.max(mx, axis=0)
    lo = _key(kmin).to(tl.float32, bitcast=True)
    hi = _key(kmax).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(hi - lo, 255.0)
    div = tl.where(scale > 0.0, scale, 1.0)
    tl.store(scales_ptr + c, scale)
    tl.store(offsets_ptr + c, lo)
    tl.store(his_ptr + c, hi)
    tl.store(bad_ptr + c, (tl.max(am, axis=0) > 0x7E967699).to(tl.int32))
    for t in range(0, length, BLOCK):
        m = t + offs < length
        x = tl.load(x_ptr + start + t + offs, mask=m, other=0.0)
        q = tl.math.div_rn(x - lo, div)
        q = tl.minimum(tl.maximum(q, 0.0), 255.0)  # q >= 0 always; > 255 only for denormal scales
        r = (q + 8388608.0) - 8388608.0  # round half to even, exact for 0 <= q < 2**23
        tl.store(codes_ptr + start + t + offs, (r.to(tl.int32) - 128).to(tl.int8), mask=m)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, offsets_ptr, out_ptr, numel, chunk, w,
                    ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    c = offs // chunk
    s = tl.load(scales_ptr + c, mask=m, other=0.0)
    o = tl.load(offsets_ptr + c, mask=m, other=0.0)
    q = tl.load(codes_ptr + offs, mask=m, other=0).to(tl.float32)
    y = (q + 128.0) * s + o  # three roundings: the launch disables FMA contraction
    if ACCUMULATE:
        y = tl.load(out_ptr + offs, mask=m, other=0.0) + y * w  # w == 1.0: the product is exact
    tl.store(out_ptr + offs, y, mask=m)


def _split(buf: torch.Tensor, numel: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales (n,) f32, offsets (n,) f32, codes (numel,) int8) views of a uint8 payload tensor."""
    n = ref.num_chunks(numel, chunk_size)
    return buf[: 4 * n].view(torch.float32), buf[4 * n : 8 * n].view(torch.float32), buf[8 * n :].view(torch.int8)


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError("expected a 1-D float32 tensor")
    return x.contiguous()


def encode_into(x: torch.Tensor, out: torch.Tensor, chunk_size: int = ref.CHUNK_SIZE) -> torch.Tensor:
    """Encode float32 ``x`` (numel,) into the uint8 tensor ``out`` (encoded_nbytes,) on the same device.

    The bytes equal ``int8.encode(x.cpu())``. Raises ValueError for NaN, Inf or |x| > MAX_ABS_VALUE
    (after the kernel ran: ``out`` is then partly written). Synchronises with the host once.
    """
    x = _check_x(x)
    numel = x.numel()
    nbytes = ref.encoded_nbytes(numel, chunk_size)
    if out.dtype != torch.uint8 or out.shape != (nbytes,) or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape ({nbytes},) on {x.device}")
    if numel == 0:
        return out
    scales, offsets, codes = _split(out, numel, chunk_size)
    n = scales.numel()
    his = torch.empty(n, dtype=torch.float32, device=x.device)  # (n,) chunk maxima
    bad = torch.empty(n, dtype=torch.int32, device=x.device)  # (n,) 1 where NaN/Inf/out of range
    _encode_kernel[(n,)](x, scales, offsets, his, bad, codes, numel, chunk_size, BLOCK=_BLOCK,
                         enable_fp_fusion=False)
    if bool(bad.any()):
        c = int(bad.nonzero()[0, 0])
        raise ValueError(f"input has NaN, Inf or |x| > {ref.MAX_ABS_VALUE:g} in chunk {c}")
    zero = (offsets == 0) | (his == 0)  # (n,) min or max is a zero of either sign
    if bool(zero.any()):
        _fix_signed_zeros(x, chunk_size, scales, offsets, zero)
    return out


def _fix_signed_zeros(x: torch.Tensor, chunk_size: int, scales: torch.Tensor, offsets: torch.Tensor,
                      zero: torch.Tensor) -> None:
    """Take scale and offset of zero-extremum chunks from the reference's CPU ``amin``/``amax`` calls."""
    zero_cpu = zero.cpu()
    for c, r, w in ref._row_blocks(x.numel(), chunk_size):
        sel = zero_cpu[c : c + r]
        if not bool(sel.any()):
            continue
        rows = x[c * chunk_size : c * chunk_size + r * w].cpu().view(r, w)  # the reference's block
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
        scale = (hi - lo) / 255.0
        idx = sel.nonzero().flatten()
        scales[c + idx.to(scales.device)] = scale[idx].to(scales.device)
        offsets[c + idx.to(offsets.device)] = lo[idx].to(offsets.device)


def encode(x: torch.Tensor, chunk_size: int = ref.CHUNK_SIZE) -> torch.Tensor:
    """Encode ``x`` into a new uint8 tensor on ``x``'s device (see :func:`encode_into`)."""
    out = torch.empty(ref.encoded_nbytes(x.numel(), chunk_size), dtype=torch.uint8, device=x.device)
    return encode_into(x, out, chunk_size)


def _validate(payload: torch.Tensor, numel: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's payload checks (int8._parse), on device; CodecError names the first bad chunk."""
    expected = ref.encoded_nbytes(numel, chunk_size)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise CodecError("payload must be a contiguous 1-D uint8 tensor")
    if payload.numel() != expected:
        raise CodecError(f"int8 payload has {payload.numel()} bytes, expected {expected} (numel={numel}, chunk_size={chunk_size})")
    s, o, codes = _split(payload, numel, chunk_size)
    n = s.numel()
    checks = ref.scale_checks(s, o)
    bad = torch.stack([b for b, _ in checks])  # (6, n) bool: one host sync for all checks
    if bool(bad.any()):
        rows = bad.any(dim=1).cpu().numpy()
        i = int(np.argmax(rows))
        raise CodecError(f"int8 payload: {checks[i][1]} in chunk {int(bad[i].nonzero()[0, 0])} of {n}")
    return s, o, codes


def decode_accumulate(payload: torch.Tensor, numel: int, acc: torch.Tensor, weight: float = 1.0,
                      chunk_size: int = ref.CHUNK_SIZE) -> None:
    """``acc += weight * decode(payload)`` on the GPU; values equal ``int8.decode_accumulate`` on CPU.

    ``payload`` is a uint8 tensor on ``acc``'s device. On CodecError ``acc`` is unchanged.
    """
    if acc.dtype != torch.float32 or acc.shape != (numel,) or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous float32 tensor of shape ({numel},)")
    if not np.isfinite(weight):
        raise ValueError(f"weight must be finite, got {weight}")
    s, o, codes = _validate(payload, numel, chunk_size)
    if numel:
        grid = (triton.cdiv(numel, _BLOCK),)
        _dequant_kernel[grid](codes, s, o, acc, numel, chunk_size, float(np.float32(weight)), ACCUMULATE=True,
                              BLOCK=_BLOCK, enable_fp_fusion=False)


def decode(payload: torch.Tensor, numel: int, chunk_size: int = ref.CHUNK_SIZE) -> torch.Tensor:
    """Decode into a new float32 tensor on ``payload``'s device; values equal ``int8.decode`` on CPU."""
    s, o, codes = _validate(payload, numel, chunk_size)
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if numel:
        grid = (triton.cdiv(numel, _BLOCK),)
        _dequant_kernel[grid](codes, s, o, out, numel, chunk_size, 1.0, ACCUMULATE=False, BLOCK=_BLOCK,
                              enable_fp_fusion=False)
    return out
