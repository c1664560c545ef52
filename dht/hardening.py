"""Guards around hivemind code that decodes bytes from other peers before our validator runs.

hivemind's DHT RPC handlers decode dictionary values and subkeys with ``MSGPackSerializer``,
whose ext hook decodes nested tuples recursively in C and Python: a 941-byte payload of 200
nested tuples crashed a process with SIGSEGV (msgpack 1.2.4, CPython 3.11). ``install`` caps that
nesting so such a payload is refused with an exception the RPC layer turns into an error reply.
Our own records never use ext types (dht/records.py rejects them outright).
"""

from __future__ import annotations

import threading
from typing import Any

MAX_EXT_DEPTH = 8  # hivemind's own values nest at most 2-3 ext levels (dictionary -> tuple)
_state = threading.local()


class ExtNestingError(ValueError):
    """A peer sent msgpack ext types nested deeper than MAX_EXT_DEPTH."""


def install() -> None:
    """Idempotently wraps ``MSGPackSerializer._decode_ext_types`` with a per-thread depth cap."""
    from hivemind.utils.serializer import MSGPackSerializer

    if getattr(MSGPackSerializer, "_hivetrain_guarded", False):
        return
    original = MSGPackSerializer._decode_ext_types.__func__  # type: ignore[attr-defined]

    def guarded(cls: Any, type_code: int, data: bytes) -> Any:
        depth = getattr(_state, "depth", 0)
        if depth >= MAX_EXT_DEPTH:
            raise ExtNestingError(f"msgpack ext types nested deeper than {MAX_EXT_DEPTH}")
        _state.depth = depth + 1
        try:
            return original(cls, type_code, data)
        finally:
            _state.depth = depth

    MSGPackSerializer._decode_ext_types = classmethod(guarded)  # type: ignore[method-assign,assignment]
    MSGPackSerializer._hivetrain_guarded = True  # type: ignore[attr-defined]


def nested_tuple_payload(depth: int = 200) -> bytes:
    """The hostile payload itself: ``depth`` tuples nested in hivemind's ext encoding (for tests)."""
    import msgpack

    packed = msgpack.packb(0)
    for _ in range(depth):
        packed = msgpack.packb(msgpack.ExtType(0x40, b"\x91" + packed))
    return packed
