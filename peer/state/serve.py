"""Serving this peer's recent states to peers that sync: a ``Service`` on the link (peer/net/link.py).

A request is a ``state_req`` header with no body: index -1 asks for the manifest of state ``base``
at round ``round`` (parent, link, piece hashes; peer/state/snapshot.py), index i >= 0 for its piece
i. The reply is a ``state_resp`` header (ok, or why not) and the manifest or the piece as its body.
The link's server caps the streams served at once (``MAX_SERVING``, ``MAX_PER_REQUESTER`` per
authenticated requester), refusing the excess with BUSY, and puts a deadline on the reply's write
(``WRITE_TIMEOUT``): a requester that never reads pins no memory here. What we send is asked of a
``Serving`` behaviour at the last moment, so tests and the simulator can make a donor lie without
the protocol code knowing.
"""

from __future__ import annotations

from typing import Any, Protocol

from hivetrain.peer.net.link import Reply, Server
from hivetrain.peer.net.wire import ZERO, Code, reason
from hivetrain.peer.state.snapshot import Snapshot

PROTOCOL_VERSION = 3  # 2: the link's framing and caps (version 1 had its own handler and frames); 3: a state's population in its manifest
MAX_SERVING = 32  # streams served at once (a piece reply holds ~1 MiB until written)
MAX_PER_REQUESTER = 4  # per requesting peer: a download keeps two pieces in flight per donor
WRITE_TIMEOUT = 20.0  # seconds to write one reply


def protocol_name(spec_hash: str) -> str:
    return f"hivetrain/state/{PROTOCOL_VERSION}/{spec_hash[:32]}"


class Serving(Protocol):
    """How this peer acts where state serving gives it something to send (the honest one: as is)."""

    def served_piece(self, round_: int, index: int, body: bytes) -> bytes:
        """Piece ``index`` of our state of round ``round_``, as we send it."""
        ...


class StateService:
    """Serves the snapshots ``serve`` was given (the latest two rounds); construct, then serve
    ``server`` on the link under ``protocol``."""

    max_body = 0  # requests have no body

    def __init__(self, spec_hash: str, behaviour: Serving):
        self.run, self.behaviour = spec_hash, behaviour
        self.protocol = protocol_name(spec_hash)
        self.server = Server(self, max_others=MAX_SERVING, max_per_peer=MAX_PER_REQUESTER, write_timeout=WRITE_TIMEOUT)
        self._served: dict[str, Snapshot] = {}  # state hash -> snapshot; the last two rounds
        self.requests = 0  # requests answered (the simulator and tests read it)

    def serve(self, snapshot: Snapshot) -> None:
        """Offers ``snapshot`` (training thread); keeps the previous round's for syncs in flight."""
        keep = {h: s for h, s in self._served.items() if s.round >= snapshot.round - 1}
        keep[snapshot.hash] = snapshot
        self._served = keep  # one atomic rebinding: the loop thread sees the old or the new dict

    def is_member(self, peer: str) -> bool:
        return False  # nobody gets more than the per-requester share

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Reply:
        return {"type": "ack", "run": self.run, "round": header.get("round", 0), "base": header.get("base", ZERO),
                "code": int(code), "reason": reason(why)}, b""

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Reply:
        if header["type"] != "state_req":
            return self.refusal(header, Code.MALFORMED, f"{header['type']} is not a state request")
        if header["run"] != self.run:
            return self.refusal(header, Code.FOREIGN, "a state request for another run spec")
        if body_len:
            return self.refusal(header, Code.WRONG_SIZE, "a state request has no body")
        self.requests += 1
        index = header["index"]
        fields = {"type": "state_resp", "run": self.run, "round": header["round"], "base": header["base"],
                  "index": index}
        snapshot = self._served.get(header["base"])
        if snapshot is None or snapshot.round != header["round"]:
            return {**fields, "ok": False, "reason": "state not held here"}, b""
        if index == -1:
            return {**fields, "ok": True, "reason": ""}, snapshot.manifest()
        if index >= len(snapshot.piece_hashes):
            return {**fields, "ok": False, "reason": "no such piece"}, b""
        body = self.behaviour.served_piece(snapshot.round, index, snapshot.piece(index))
        return {**fields, "ok": True, "reason": ""}, body
