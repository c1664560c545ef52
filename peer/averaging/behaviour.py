"""How this peer acts where a protocol gives it something to send.

The protocol code asks a ``Behaviour`` at each such point; the honest one sends what the protocol
computed. Faults and attacks are other behaviours, injected from outside: the hidden ``--fault``
flag builds one (peer/faults.py), the protocol tests and the simulator's attack library
(peer/sim/attacks.py) build their own. Besides averaging, state serving (peer/state/serve.py
``Serving``) and the dial-back check (peer/net/dialback.py ``Answering``) ask it too.
"""

from __future__ import annotations

from typing import Any

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

    def part_for(self, round_: int, shard: int, recipient: str, auditor: bool, part: bytes) -> bytes:
        """Our part of ``shard`` as sent to ``recipient`` (its reducer, or its auditor if ``auditor``)."""
        return part

    def relay_for(self, round_: int, shard: int, member: str, part: bytes) -> bytes | None:
        """A slow member's part of the shard we reduce, as we relay it to the shard's auditor (None:
        we say we refused it)."""
        return part

    def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int, codec: Codec) -> bytes:
        """The result of the shard we reduced, as sent to ``recipient``."""
        return result

    def finding(self, round_: int, shard: int, finding: Finding | None) -> Finding | None:
        """Our audit's finding on the shard we audit (None: the result is right)."""
        return finding

    def verdict_for(self, round_: int, shard: int, recipient: str, ok: bool) -> bool:
        """Our verdict as sent to ``recipient``."""
        return ok

    def mean_for(self, round_: int, shard: int, sub: int, mean: bytes, numel: int, codec: Codec) -> bytes:
        """The mean of sub-piece (``shard``, ``sub``) we averaged across groups as a designee, as we send it."""
        return mean

    def averaged(self, round_: int, base: str, shard: int, sub: int, groups: list[Any], numel: int,
                 codec: Codec) -> list[Any]:
        """The groups' sub-pieces (peer/averaging/cross.py ``_Entry``, with the weights we give them)
        that we average as the designee of sub-piece (``shard``, ``sub``)."""
        return groups

    def countersigns(self, round_: int, shard: int, sub: int, designee: str) -> bool:
        """Whether, as a witness, we sign ``designee``'s mean of sub-piece (``shard``, ``sub``) unchecked
        (a designee colluding with it); False: we check it (cross.py ``Desk.check``)."""
        return False

    def served_piece(self, round_: int, index: int, body: bytes) -> bytes:
        """Piece ``index`` of our state of round ``round_`` as we serve it to a peer that syncs."""
        return body

    def dialback_answer(self, asker: str, connected: bool) -> bool:
        """What we tell ``asker`` about whether we could open a connection to it."""
        return connected


HONEST = Behaviour()
