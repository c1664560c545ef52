"""Fast CPU int8 codec: a small C kernel compiled at first use, bit-identical to the reference.

This module produces exactly the bytes of :func:`hivetrain.kernels.int8.encode_reference` and exactly
the float32 values of ``decode_reference`` / ``decode_accumulate_reference`` (the wire format and the
op order are specified in :mod:`hivetrain.kernels.int8`), several times faster.

**Choice of tool** (measured on the project machine: 2 vCPUs of an AMD EPYC with AVX-512, shared with
other jobs; 100M elements; ``python -m bench.codec`` reproduces the numbers):

* *C compiled at first use with the system compiler, called through ctypes* (chosen). About 60 lines
  of plain C that gcc/clang auto-vectorise for the host (``-march=native``: AVX-512 or AVX2 on x86,
  NEON on arm64, with a default-target retry), plus two x86 touches a compiler cannot infer: software
  prefetch of the next chunk while the current one (resident in L2) is quantized, and non-temporal
  stores of the codes for large tensors. With 1 thread, encode runs at ~25 GB/s and
  dequantize-accumulate at ~26 GB/s while ``x.sum()`` reads at ~40 GB/s (reference: 2.9 and 5.1 GB/s);
  dequantize-accumulate is as fast as a bare C ``acc[i] += q[i]`` loop, i.e. at the memory limit.
  ctypes releases the GIL, so ``T = torch.get_num_threads()`` Python threads run ``T`` contiguous
  ranges of chunks: no OpenMP runtime to clash with torch's. Needs ``cc``/``gcc``/``clang`` at run
  time (as ``torch.compile`` does); no Python headers, no new pip dependency.
* *numba* (pip wheels, no compiler): the same loops were not vectorised (the integer min/max
  reductions and the ``rint`` + int8 narrowing stayed scalar, with ``error_model="numpy"`` and
  ``fastmath=False``, which bit-exactness needs): 2.5 GB/s encode and 8 GB/s dequantize-accumulate,
  10x slower than C, plus a 50 MB dependency and 1-3 s of JIT per process. No prefetch or
  non-temporal stores either.
* *torch.compile (inductor C++)*: needs the same compiler, and shared/research/codec.md measured it at
  3-7 GB/s for the per-chunk encode and 2.6 GB/s for int8 dequantize.

Fresh outputs (the ``bytes`` of :func:`encode`, the tensor of :func:`decode`) are advised onto
transparent huge pages on Linux: 4 KB page faults otherwise cost more than the kernel (100M elements:
public ``encode`` 6 -> 16 GB/s, ``decode`` 2.5 -> 14 GB/s). Hot paths should still reuse buffers:
:func:`encode_into`, :func:`decode_into`, :func:`decode_accumulate`.

**Bit-exactness.** The kernel follows the reference op for op in float32: ``scale = (hi - lo) / 255``,
``code = clamp(rint((x - lo) / scale), 0, 255) - 128`` with a true IEEE division (no reciprocal) and
``rint`` (round half to even); decode is ``((float)code + 128) * scale + offset`` then ``* weight`` and
``acc + ...``, each rounded separately: compiled with ``-ffp-contract=off`` (no FMA) and without
``-ffast-math``. The chunk min/max is taken on integer keys of the float bits (exact, vectorisable,
and an out-of-range or NaN input shows as a key above ``bits(1e38)``). The only value the reference
leaves to torch's reduction order is the *sign of a zero* min or max (``amin`` of ``{-0.0, +0.0}``):
for those rare chunks the scale and offset are recomputed with the reference's own torch calls, so
even those bytes match (the codes do not depend on that sign). After building, a self-test compares
the library with the reference on edge cases and refuses it on any difference.

**No silent downgrade.** If no compiler is found, the build fails or the self-test disagrees,
:func:`load` returns False, :data:`UNAVAILABLE_REASON` says why, one warning is logged, and
``hivetrain.kernels.int8.ACTIVE_PATH`` is ``"reference"`` (the same bytes, ~5x slower). The build is
cached in ``~/.cache/hivetrain/kernels`` (or a per-user temp dir; a directory others can write is
refused) under a hash of the source, flags and CPU.

Thread safety: every function may be called from any thread; calls do not share mutable state
(the worker pool is created under a lock).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .errors import CodecError

log = logging.getLogger(__name__)

NAME = "c"  # the value of int8.ACTIVE_PATH when this path is active
NT_MIN_NUMEL = 1 << 24  # non-temporal code stores from 16M elements (64 MB in, 16 MB of codes): beyond the
# L3 (32 MB on the test EPYC); at 10M elements, cached stores measured 0.88 of the limit against 0.74
MIN_NUMEL_PER_THREAD = 1 << 20  # below ~4 MB per thread, handing work to a thread costs more than it saves
BLOCK_NUMEL = 1 << 21  # at most ~8 MB of float32 per scheduling block: small enough to rebalance, ~ms each
_ABI = 2

_C_SOURCE = r"""
/* hivetrain int8 codec kernels. Compile with -ffp-contract=off and without -ffast-math. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define HV_ABI 2
#define HV_MAX_ABS_BITS 0x7E967699u /* bit pattern of (float)1e38: |x| above it, Inf and NaN are invalid */
#define HV_GROUP 64                 /* elements per step: one 64-byte line of codes */

int hv_abi(void) { return HV_ABI; }

int hv_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 3;
#elif defined(__AVX2__)
    return 2;
#elif defined(__SSE2__)
    return 1;
#else
    return 0;
#endif
}

/* Sign-magnitude float bits -> two's complement key with the same order (-0.0 sorts below +0.0). */
static inline int32_t hv_key(int32_t b) { return b ^ ((b >> 31) & 0x7fffffff); }

static inline float hv_float_of_key(int32_t k) {
    int32_t b = hv_key(k); /* the map is its own inverse */
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline void hv_stats_run(const int32_t *restrict b, int64_t n, int32_t *kmin, int32_t *kmax,
                                uint32_t *amax) {
    int32_t mn = *kmin, mx = *kmax;
    uint32_t am = *amax;
    for (int64_t i = 0; i < n; i++) {
        int32_t v = b[i];
        int32_t k = hv_key(v);
        uint32_t a = (uint32_t)v & 0x7fffffffu;
        mn = k < mn ? k : mn;
        mx = k > mx ? k : mx;
        am = a > am ? a : am;
    }
    *kmin = mn;
    *kmax = mx;
    *amax = am;
}

/* Chunk statistics in blocks of HV_SBLOCK elements; before each block, prefetch HV_SBLOCK / 2
   elements of the first half of the next chunk (pf, npf elements in all; the quantize pass fetches
   the second half). Measured: without it DRAM idles while the statistics of a chunk already in L2
   are computed, and encode stayed at ~0.79 of the memory limit. */
#define HV_SBLOCK 1024
static void hv_stats(const int32_t *b, int64_t n, int32_t *kmin, int32_t *kmax, uint32_t *amax,
                     const float *pf, int64_t npf) {
    int64_t i = 0, half = npf / 2;
    for (; i + HV_SBLOCK <= n; i += HV_SBLOCK) {
        for (int64_t j = i / 2; j < i / 2 + HV_SBLOCK / 2 && j < half; j += 16) __builtin_prefetch(pf + j, 0, 3);
        hv_stats_run(b + i, HV_SBLOCK, kmin, kmax, amax);
    }
    hv_stats_run(b + i, n - i, kmin, kmax, amax);
}

/* code = clamp(rint((x - lo) / div), 0, 255) - 128. rint rounds half to even (default mode);
   the clamp is done on the integer, which is exact: the rounded quotient is below 2^31. */
static inline void hv_quant(const float *restrict x, int64_t n, float lo, float div, int8_t *restrict q) {
    for (int64_t i = 0; i < n; i++) {
        int32_t t = (int32_t)rintf((x[i] - lo) / div);
        t = t < 0 ? 0 : t;
        t = t > 255 ? 255 : t;
        q[i] = (int8_t)(t - 128);
    }
}

/* Quantize one chunk; prefetch the second half of the next chunk (pf, npf elements in all; hv_stats
   fetched the first half) so DRAM works while we compute. */
static void hv_quant_chunk(const float *x, int64_t n, float lo, float div, int8_t *q,
                           const float *pf, int64_t npf, int nt) {
    int64_t i = 0;
#if defined(__SSE2__)
    if (nt) { /* non-temporal stores need 64-byte aligned lines: do the head normally */
        int64_t head = (int64_t)((64 - ((uintptr_t)q & 63)) & 63);
        if (head > n) head = n;
        hv_quant(x, head, lo, div, q);
        i = head;
    }
#endif
    const int64_t half = npf / 2;
    for (; i + HV_GROUP <= n; i += HV_GROUP) {
        if (half + i / 2 < npf) {
            for (int j = 0; j < HV_GROUP / 2; j += 16) __builtin_prefetch(pf + half + i / 2 + j, 0, 3);
        }
#if defined(__SSE2__)
        if (nt) {
            int8_t tmp[HV_GROUP] __attribute__((aligned(64)));
            hv_quant(x + i, HV_GROUP, lo, div, tmp);
#if defined(__AVX512F__)
            _mm512_stream_si512((void *)(q + i), _mm512_load_si512((const void *)tmp));
#elif defined(__AVX2__)
            _mm256_stream_si256((__m256i *)(q + i), _mm256_load_si256((const __m256i *)tmp));
            _mm256_stream_si256((__m256i *)(q + i + 32), _mm256_load_si256((const __m256i *)(tmp + 32)));
#else
            for (int j = 0; j < HV_GROUP; j += 16)
                _mm_stream_si128((__m128i *)(q + i + j), _mm_load_si128((const __m128i *)(tmp + j)));
#endif
            continue;
        }
#endif
        hv_quant(x + i, HV_GROUP, lo, div, q + i);
    }
    hv_quant(x + i, n - i, lo, div, q + i);
}

/* Encode chunks [c0, c1) of x (numel elements, chunk elements per chunk) into scales[c], offsets[c]
   (possibly unaligned), his[c] (the chunk max, for the caller's signed-zero check) and codes.
   Returns -1, or the first chunk holding NaN, Inf or |x| > 1e38 (then the outputs are partial). */
int64_t hv_encode(const float *x, int64_t numel, int64_t chunk, int64_t c0, int64_t c1,
                  float *scales, float *offsets, float *his, int8_t *codes, int nt) {
    for (int64_t c = c0; c < c1; c++) {
        int64_t s = c * chunk, len = numel - s;
        if (len > chunk) len = chunk;
        int32_t mn = INT32_MAX, mx = INT32_MIN;
        uint32_t am = 0;
        int64_t nlen = 0;
        if (c + 1 < c1) {
            nlen = numel - s - chunk;
            if (nlen > chunk) nlen = chunk;
        }
        hv_stats((const int32_t *)(x + s), len, &mn, &mx, &am, x + s + chunk, nlen); /* chunk now in L2 */
        if (am > HV_MAX_ABS_BITS) return c;
        float lo = hv_float_of_key(mn), hi = hv_float_of_key(mx);
        float scale = (hi - lo) / 255.0f;
        float div = scale > 0.0f ? scale : 1.0f;
        memcpy(scales + c, &scale, 4);
        memcpy(offsets + c, &lo, 4);
        his[c] = hi;
        hv_quant_chunk(x + s, len, lo, div, codes + s, x + s + chunk, nlen, nt);
    }
#if defined(__SSE2__)
    if (nt) _mm_sfence();
#endif
    return -1;
}

/* out = dequant (accumulate == 0) or out = out + dequant * w (w == 1: the product is skipped, it is
   exact), with dequant = ((float)code + 128) * scale + offset, every op rounded on its own.
   Works in groups of 64 elements and prefetches codes and outputs HV_PF elements ahead (bounded by
   the end of this call's range): measured +4-6% on the EPYC, where the hardware prefetcher alone
   leaves the read-modify-write stream short of the memory limit. */
#define HV_PF 2048
static inline void hv_deq_run(const int8_t *restrict qq, float *restrict o, int64_t len, float sc, float of,
                              int accumulate, float w) {
    if (!accumulate) {
        for (int64_t i = 0; i < len; i++) o[i] = ((float)qq[i] + 128.0f) * sc + of;
    } else if (w == 1.0f) {
        for (int64_t i = 0; i < len; i++) o[i] = o[i] + (((float)qq[i] + 128.0f) * sc + of);
    } else {
        for (int64_t i = 0; i < len; i++) o[i] = o[i] + ((((float)qq[i] + 128.0f) * sc + of) * w);
    }
}

void hv_dequant(const int8_t *q, int64_t numel, int64_t chunk, int64_t c0, int64_t c1,
                const float *scales, const float *offsets, float *out, int accumulate, float w) {
    int64_t end = c1 * chunk < numel ? c1 * chunk : numel;
    for (int64_t c = c0; c < c1; c++) {
        int64_t s = c * chunk, len = numel - s;
        if (len > chunk) len = chunk;
        const float sc = scales[c], of = offsets[c];
        int64_t i = 0;
        for (; i + HV_GROUP <= len; i += HV_GROUP) {
            int64_t p = s + i + HV_PF;
            if (p + HV_GROUP <= end) {
                __builtin_prefetch(q + p, 0, 3);
                for (int j = 0; j < HV_GROUP; j += 16) __builtin_prefetch(out + p + j, 0, 3);
            }
            hv_deq_run(q + s + i, out + s + i, HV_GROUP, sc, of, accumulate, w);
        }
        hv_deq_run(q + s + i, out + s + i, len - i, sc, of, accumulate, w);
    }
}

/* Dynamic scheduling: every thread calls once with the same counter and takes blocks of per_block
   chunks until none are left (one call per thread: no Python, no GIL between blocks). */
int64_t hv_encode_dyn(const float *x, int64_t numel, int64_t chunk, int64_t n_chunks, int64_t per_block,
                      int64_t *next, float *scales, float *offsets, float *his, int8_t *codes, int nt) {
    int64_t bad = -1;
    for (;;) {
        int64_t c0 = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * per_block;
        if (c0 >= n_chunks) break;
        int64_t c1 = c0 + per_block < n_chunks ? c0 + per_block : n_chunks;
        int64_t r = hv_encode(x, numel, chunk, c0, c1, scales, offsets, his, codes, nt);
        if (r >= 0 && (bad < 0 || r < bad)) bad = r;
    }
    return bad;
}

void hv_dequant_dyn(const int8_t *q, int64_t numel, int64_t chunk, int64_t n_chunks, int64_t per_block,
                    int64_t *next, const float *scales, const float *offsets, float *out, int accumulate, float w) {
    for (;;) {
        int64_t c0 = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * per_block;
        if (c0 >= n_chunks) break;
        int64_t c1 = c0 + per_block < n_chunks ? c0 + per_block : n_chunks;
        hv_dequant(q, numel, chunk, c0, c1, scales, offsets, out, accumulate, w);
    }
}
"""

_BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno")
_ARCH_FLAGS = (("-march=native",), ())  # tried in order; the second is the compiler's default target
_ISA_NAMES = {3: "avx512", 2: "avx2", 1: "sse2", 0: "generic"}

_lock = threading.RLock()  # guards the one-time build; re-entered by the self-test on the same thread
_pool_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False
UNAVAILABLE_REASON: str | None = "not loaded yet"
BUILD_INFO: str = ""  # e.g. "gcc -march=native, avx512, /root/.cache/hivetrain/kernels/int8_cpu_....so"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0

_HUGE_PAGE = 1 << 21
try:  # Linux: madvise(MADV_HUGEPAGE) on fresh output buffers, see _advise_huge_pages
    _madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _madvise = None
if _madvise is not None:
    _madvise.restype = ctypes.c_int
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.restype = ctypes.c_void_p
_PyBytes_AsString.argtypes = (ctypes.py_object,)


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    """Ask Linux to back the 2 MB-aligned inside of a fresh buffer with transparent huge pages.

    A new 100 MB output costs ~25,000 4 KB page faults on first touch, which made ``encode`` (new
    bytes) and ``decode`` (new tensor) 3-10x slower than the kernels writing into reused buffers.
    With THP in ``madvise`` mode (a common default) this takes ~50 faults. Advice only: the contents
    do not change, errors are ignored, and other systems skip it.
    """
    if _madvise is None or nbytes < 4 * _HUGE_PAGE:
        return
    lo = (addr + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    hi = (addr + nbytes) & ~(_HUGE_PAGE - 1)
    if hi > lo:
        _madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE


def _cache_dir() -> Path:
    """A directory only this user can write (a shared one could be used to plant a library we load)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for d in (Path.home() / ".cache" / "hivetrain" / "kernels",
              Path(tempfile.gettempdir()) / f"hivetrain-{uid if uid is not None else 'user'}" / "kernels"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.stat()
            if uid is not None and (st.st_uid != uid or st.st_mode & 0o022):
                continue
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no private writable cache directory for the compiled kernel")


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux), else platform strings."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compile(out_dir: Path) -> tuple[Path, str]:
    """Compile the C source once per (source, flags, CPU); return (path of the library, description)."""
    compilers = [c for c in ("cc", "gcc", "clang") if shutil.which(c)]
    if not compilers:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    errors = []
    for arch in _ARCH_FLAGS:
        key = hashlib.sha256(
            "\0".join([_C_SOURCE, *_BASE_FLAGS, *arch, sys.platform, platform.machine(), _cpu_fingerprint()]).encode()
        ).hexdigest()[:20]
        target = out_dir / f"int8_cpu_{key}.so"
        desc = f"{' '.join(arch) or 'default target'}, {target}"
        if target.exists():
            return target, desc
        for cc in compilers:
            fd, tmp_so = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            src = Path(tmp_so).with_suffix(".c")
            try:
                src.write_text(_C_SOURCE, encoding="utf-8")
                cmd = [cc, *_BASE_FLAGS, *arch, "-o", tmp_so, str(src)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
                if proc.returncode == 0:
                    os.replace(tmp_so, target)  # atomic: concurrent builders each install a complete file
                    return target, f"{cc} {desc}"
                errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{cc}: {e}")
            finally:
                for p in (Path(tmp_so), src):
                    p.unlink(missing_ok=True)
    raise OSError("compiling the int8 kernel failed: " + " | ".join(errors))


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hv_abi.restype = ctypes.c_int
    lib.hv_abi.argtypes = ()
    lib.hv_isa.restype = ctypes.c_int
    lib.hv_isa.argtypes = ()
    lib.hv_encode.restype = i64
    lib.hv_encode.argtypes = (ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int)
    lib.hv_dequant.restype = None
    lib.hv_dequant.argtypes = (ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_float)
    lib.hv_encode_dyn.restype = i64
    lib.hv_encode_dyn.argtypes = (ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int)
    lib.hv_dequant_dyn.restype = None
    lib.hv_dequant_dyn.argtypes = (ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_float)
    if lib.hv_abi() != _ABI:
        raise OSError(f"kernel ABI {lib.hv_abi()} != {_ABI}")
    return lib


def _self_test() -> str | None:
    """Compare with the reference on edge cases; return a description of the first difference, or None."""
    from . import int8 as ref

    g = torch.Generator().manual_seed(1234)
    cs = 64
    parts = [
        torch.randn(3 * cs, generator=g),
        torch.full((cs,), 3.25),
        torch.zeros(cs),
        -torch.zeros(cs),
        torch.where(torch.arange(cs) % 3 == 0, -0.0, 0.0),
        torch.tensor([0.0, -0.0, 1.0, 2.5]).repeat(cs // 4),
        torch.randn(cs, generator=g) / torch.randn(3, cs, generator=g).pow(2).mean(0).sqrt(),  # Student-t(3)
        torch.tensor([-1e38, 1e38]).repeat(cs // 2),
        torch.tensor([1e-45, 2e-45, 0.0, -1e-45]).repeat(cs // 4),
        torch.randn(cs - 5, generator=g) * 1e-3 + 7.0,
    ]
    x = torch.cat(parts).float()
    p_ref = ref.encode_reference(x, cs)
    p_fast = encode(x, cs)
    if p_fast != p_ref:
        return "encode bytes differ from the reference"
    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:  # torch.equal would let -0.0 == +0.0 pass
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    if not same_bits(decode(p_ref, x.numel(), cs), ref.decode_reference(p_ref, x.numel(), cs)):
        return "decode differs from the reference"
    for w in (1.0, 0.3, -2.5, 0.0):
        a = torch.randn(x.numel(), generator=g)
        b = a.clone()
        decode_accumulate(p_ref, x.numel(), a, w, cs)
        ref.decode_accumulate_reference(p_ref, x.numel(), b, w, cs)
        if not same_bits(a, b):
            return f"decode_accumulate (weight={w}) differs from the reference"
    return None


def load() -> bool:
    """Build (or reuse the cached build) and self-test the kernel once; True if the fast path is usable.

    Never raises: on failure it sets :data:`UNAVAILABLE_REASON`, logs one warning and returns False.
    """
    global _lib, _loaded, UNAVAILABLE_REASON, BUILD_INFO
    # Importing int8 first settles the import cycle: int8's own import ends by calling load(), so when
    # this returns int8 is complete (or, if int8 is the caller, it is in sys.modules with the references).
    from . import int8  # noqa: F401

    with _lock:
        if _loaded:
            return _lib is not None
        _loaded = True
        try:
            path, desc = _compile(_cache_dir())
            _lib = _bind(path)
            BUILD_INFO = f"{desc} [{_ISA_NAMES.get(_lib.hv_isa(), '?')}]"
            bad = _self_test()
            if bad is not None:
                raise OSError(f"self-test failed: {bad} ({BUILD_INFO})")
            UNAVAILABLE_REASON = None
        except Exception as e:  # any failure means: use the reference, loudly (no silent downgrade)
            _lib = None
            UNAVAILABLE_REASON = f"{type(e).__name__}: {e}"
            log.warning(
                "hivetrain int8 codec: fast C path unavailable (%s); using the pure-torch reference "
                "(same bytes, about 5x slower). Install a C compiler (gcc or clang) to enable it.",
                UNAVAILABLE_REASON,
            )
        return _lib is not None


def available() -> bool:
    """True when the compiled kernel is loaded and passed its self-test (builds it on first call)."""
    return load()


def _require() -> ctypes.CDLL:
    if not load() or _lib is None:
        raise RuntimeError(f"fast CPU int8 kernel unavailable: {UNAVAILABLE_REASON}")
    return _lib


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:  # the old pool may still be in use: left to the GC
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hivetrain-int8")
            _pool_size = workers
        return _pool


def _run_split(fn: Callable[[int, int], int | None], n_chunks: int, numel: int) -> list[int | None]:
    """Run ``fn(per_block, counter_address)`` once on each of ``T <= torch.get_num_threads()``
    threads; the C side takes blocks of ``per_block`` chunks from the shared counter until none are left.

    Dynamic scheduling: on a volunteer's machine another process often holds a core for a few ms,
    and with one fixed range per thread the whole call then waits for the slowed thread (2-thread
    results on the 2-core test machine varied 0.67-0.90 of the memory limit with fixed halves).
    The blocks are taken inside C (an atomic counter), not in Python: handing blocks out from Python
    threads cost up to half the speed at 10M elements (GIL hand-overs between blocks).
    Returns every thread's result (order unspecified).
    """
    t = max(1, min(torch.get_num_threads(), n_chunks, numel // MIN_NUMEL_PER_THREAD))
    counter = ctypes.c_int64(0)
    addr = ctypes.addressof(counter)
    if t == 1:
        return [fn(n_chunks, addr)]
    per_block = max(1, min(-(-n_chunks // (4 * t)), -(-n_chunks * BLOCK_NUMEL // numel)))  # chunks per block
    futures = [_get_pool(t - 1).submit(fn, per_block, addr) for _ in range(t - 1)]
    results = [fn(per_block, addr)]  # the calling thread works too
    results += [f.result() for f in futures]
    return results


def _fix_signed_zeros(x: torch.Tensor, chunk_size: int, scales: np.ndarray, offsets: np.ndarray,
                      his: torch.Tensor) -> None:
    """Where a chunk's min or max is a zero, take its sign (and the scale) from the reference's torch calls.

    ``amin``/``amax`` of {-0.0, +0.0} is decided by torch's reduction order; the codes do not depend
    on it, only these two floats do. ``scales``/``offsets`` are (n,) float32 views of the output.
    """
    from . import int8 as ref

    n = his.numel()
    lo_t = torch.from_numpy(offsets.copy())  # (n,) float32
    zero = (lo_t == 0) | (his == 0)  # (n,) bool, true for either sign
    if not bool(zero.any()):
        return
    numel = x.numel()
    for c, r, w in ref._row_blocks(numel, chunk_size):
        sel = zero[c : c + r]
        if not bool(sel.any()):
            continue
        rows = x[c * chunk_size : c * chunk_size + r * w].view(r, w)  # exactly the reference's block
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)  # (r,), (r,)
        scale = (hi - lo) / 255.0  # (r,) float32
        idx = sel.nonzero().flatten()
        scales[c + idx.numpy()] = scale[idx].numpy()
        offsets[c + idx.numpy()] = lo[idx].numpy()
    assert n == scales.shape[0]


def _encode_at(x: torch.Tensor, addr: int, chunk_size: int) -> None:
    """Encode validated contiguous float32 ``x`` into ``encoded_nbytes`` writable bytes at ``addr``."""
    from . import int8 as ref

    lib = _require()
    numel = x.numel()
    n = ref.num_chunks(numel, chunk_size)
    if numel == 0:
        return
    his = torch.empty(n, dtype=torch.float32)  # (n,) chunk maxima
    xp, hp, nt = x.data_ptr(), his.data_ptr(), int(numel >= NT_MIN_NUMEL)

    def run(per_block: int, counter: int) -> int:
        return int(lib.hv_encode_dyn(xp, numel, chunk_size, n, per_block, counter, addr, addr + 4 * n, hp,
                                     addr + 8 * n, nt))

    bad = [b for b in _run_split(run, n, numel) if b is not None and b >= 0]
    if bad:
        c = min(bad)
        raise ValueError(f"input has NaN, Inf or |x| > {ref.MAX_ABS_VALUE:g} in chunk {c}")
    header = (ctypes.c_float * (2 * n)).from_address(addr)
    hdr = np.ctypeslib.as_array(header)  # (2n,) float32 view of the output: scales | offsets
    _fix_signed_zeros(x, chunk_size, hdr[:n], hdr[n:], his)


def encode(x: torch.Tensor, chunk_size: int = 65536) -> bytes:
    """Same contract and bytes as ``int8.encode_reference``; one allocation (the returned bytes)."""
    from . import int8 as ref

    x = ref._check_input(x)
    nbytes = ref.encoded_nbytes(x.numel(), chunk_size)
    if x.numel() == 0:
        return b""
    out = _PyBytes_FromStringAndSize(None, nbytes)  # uninitialised, not yet shared: filled below
    addr = _PyBytes_AsString(out)
    assert addr is not None
    _advise_huge_pages(addr, nbytes)
    _encode_at(x, addr, chunk_size)
    return out  # type: ignore[no-any-return]


def encode_into(x: torch.Tensor, out: torch.Tensor, chunk_size: int = 65536) -> torch.Tensor:
    """Encode ``x`` into the preallocated ``out``: a contiguous CPU uint8/int8 tensor (encoded_nbytes,).

    Same bytes as ``int8.encode``; use it on the hot path to keep send buffers alive across rounds.
    Raises ValueError like ``encode`` (``out`` is then partly written), RuntimeError without the kernel.
    """
    from . import int8 as ref

    x = ref._check_input(x)
    nbytes = ref.encoded_nbytes(x.numel(), chunk_size)
    if (
        not isinstance(out, torch.Tensor) or out.dtype not in (torch.uint8, torch.int8) or out.shape != (nbytes,)
        or out.device.type != "cpu" or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous CPU uint8 tensor of shape ({nbytes},)")
    if nbytes:
        _encode_at(x, out.data_ptr(), chunk_size)
    return out


def _parse(payload: object, numel: int, chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate like ``int8._parse`` without copying the codes; return (scales, offsets, codes (numel,) int8).

    The checks and messages are those of the reference (kept in step by tests/unit/test_codec_fast.py).
    """
    from . import int8 as ref

    expected = ref.encoded_nbytes(numel, chunk_size)
    try:
        mv = memoryview(payload).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise CodecError(f"payload is not a contiguous byte buffer: {e}") from None
    if len(mv) != expected:
        raise CodecError(f"int8 payload has {len(mv)} bytes, expected {expected} (numel={numel}, chunk_size={chunk_size})")
    n = ref.num_chunks(numel, chunk_size)
    raw = np.frombuffer(mv, dtype=np.uint8)  # (expected,) no copy, read-only buffers too
    scales = raw[: 4 * n].view("<f4").copy()  # (n,) float32 private copies: validated once, used once
    offsets = raw[4 * n : 8 * n].view("<f4").copy()  # (n,) float32
    codes = raw[8 * n :].view(np.int8)  # (numel,) aliases the payload: consumed at once
    for bad, what in ref.scale_checks(torch.from_numpy(scales), torch.from_numpy(offsets)):
        if bool(bad.any()):
            raise CodecError(f"int8 payload: {what} in chunk {int(bad.nonzero()[0, 0])} of {n}")
    return scales, offsets, codes


def _dequant(payload: object, numel: int, chunk_size: int, out: torch.Tensor, accumulate: bool, weight: float) -> None:
    lib = _require()
    scales, offsets, codes = _parse(payload, numel, chunk_size)
    if numel == 0:
        return
    n = scales.shape[0]
    qp, sp, op, outp = codes.ctypes.data, scales.ctypes.data, offsets.ctypes.data, out.data_ptr()
    w = ctypes.c_float(weight)  # float32(weight), as torch's ``mul_(python_float)`` on a float32 tensor
    acc = int(accumulate)

    def run(per_block: int, counter: int) -> None:
        lib.hv_dequant_dyn(qp, numel, chunk_size, n, per_block, counter, sp, op, outp, acc, w)

    _run_split(run, n, numel)


def decode(payload: object, numel: int, chunk_size: int = 65536) -> torch.Tensor:
    """Same contract and values as ``int8.decode_reference`` (new float32 tensor, never aliases payload)."""
    out = torch.empty(numel, dtype=torch.float32)  # (numel,) float32
    _advise_huge_pages(out.data_ptr(), 4 * numel)
    _dequant(payload, numel, chunk_size, out, accumulate=False, weight=1.0)
    return out


def decode_into(payload: object, numel: int, out: torch.Tensor, chunk_size: int = 65536) -> torch.Tensor:
    """Decode into the preallocated contiguous float32 CPU tensor ``out`` (numel,); CodecError leaves it as is."""
    from . import int8 as ref

    ref._check_acc(out, numel, 1.0)
    _dequant(payload, numel, chunk_size, out, accumulate=False, weight=1.0)
    return out


def decode_accumulate(payload: object, numel: int, acc: torch.Tensor, weight: float = 1.0,
                      chunk_size: int = 65536) -> None:
    """Same contract and values as ``int8.decode_accumulate_reference``: ``acc += weight * decode(payload)``."""
    from . import int8 as ref

    ref._check_acc(acc, numel, float(weight))
    _dequant(payload, numel, chunk_size, acc, accumulate=True, weight=float(weight))

