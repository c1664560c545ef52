"""Errors of the codec kernels. A remote peer can cause every one of them by sending bad bytes."""

from __future__ import annotations


class CodecError(ValueError):
    """An encoded payload is malformed: wrong length, a non-finite or out-of-bounds scale or offset,
    values that would overflow float32 when decoded, or an unknown codec name."""
