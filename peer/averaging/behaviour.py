"""How this peer acts where the protocol gives it something to send.

The protocol code asks a ``Behaviour`` at each such point; the honest one sends what the protocol
computed. Faults and attacks are other behaviours, injected from outside: the hidden ``--fault``
flag builds one (peer/faults.py), and the protocol tests build their own.
"""

from __future__ import annotations

import torch

from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.reduce import Finding


class Behaviour:
    """The honest peer."""

    def at(self, point: str, round_: int) -> None:
        """A named point of the round was reached (process faults act here)."""

    def parts(self, round_: int, parts: list[bytes], delta: torch.Tensor, bounds: list[tuple[int, int]],
              codec: Codec) -> list[bytes]:
        """The encoded slices we send for each shard."""
        return parts

    def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int, codec: Codec) -> bytes:
        """The result of the shard we reduced, as sent to ``recipient``."""
        return result

    def finding(self, round_: int, shard: int, finding: Finding | None) -> Finding | None:
        """Our audit's finding on the shard we audit (None: the result is right)."""
        return finding

    def verdict_for(self, round_: int, shard: int, recipient: str, ok: bool) -> bool:
        """Our verdict as sent to ``recipient``."""
        return ok


HONEST = Behaviour()
