"""``Averager`` over hivemind's libp2p streams: matchmaking (peer/group.py) + audited all-reduce (peer/allreduce.py).

All coroutines run on the DHT's event loop; ``average`` is the one synchronous entry, called by
the training thread. Each message is one frame on its own libp2p stream (peer/wire.py), answered
by an ack. The sender of a message is the libp2p peer id of the stream (authenticated by the
transport), never a field the sender fills in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from hivetrain.dht.identity import Identity
from hivetrain.dht.node import DHT
from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec, get_codec
from hivetrain.peer.averaging.allreduce import DUPLICATE, AllReduce
from hivetrain.peer.averaging.api import AverageResult, shard_bounds
from hivetrain.peer.averaging.matchmaking_io import GroupFormation
from hivetrain.peer.averaging.sybil import Probation
from hivetrain.peer.averaging.views import View
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.faults import FaultPlan
from hivetrain.peer.net import transport
from hivetrain.peer.net.wire import ProtocolError, read_frame

logger = logging.getLogger(__name__)
IO_TIMEOUT = 10.0  # seconds for one small request/ack exchange
MAX_GROUPS_PER_ROUND = 4  # distinct group hashes a peer buffers messages for, per round


class P2PAverager(GroupFormation, AllReduce):
    """Averages pseudo-gradients with the peers of one run. Construct, then ``start()``."""

    def __init__(self, dht: DHT, identity: Identity, run_key: str, spec: Any, numel: int, faults: FaultPlan):
        self.dht, self.identity, self.run_key, self.spec = dht, identity, run_key, spec
        self.numel, self.faults = numel, faults
        self.codec: Codec = get_codec(spec.compression, spec.chunk_size)
        self.spec_hash = spec.spec_hash().hex()
        self.handler_name = f"hivetrain/avg/2/{self.spec_hash[:32]}"
        self.max_body = self.codec.encoded_nbytes(numel) + 64
        self.me = ""
        self.current_round = 0
        self._views: dict[int, View] = {}
        # (round, group hash, kind, shard, sender) -> payload
        self._inbox: dict[tuple[int, str, str, int, str], bytes] = {}
        self._groups_seen: dict[int, set[str]] = defaultdict(set)
        self._arrived: asyncio.Event | None = None
        self._bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self._invalid: dict[tuple[int, str, int, str], str] = {}  # (round, group, shard, sender) -> why
        self._excluded: dict[tuple[int, str, int], list[str]] = {}  # (round, group, shard) -> left out by its reducer
        self._commits: dict[tuple[int, str, int], list[str]] = {}
        self._claims: dict[tuple[int, str, int], list[str]] = {}
        self._evidence: dict[tuple[int, str, int], list[bytes]] = {}
        self._probation = Probation()
        self._verdicts: dict[tuple[int, str, int, str], tuple[bool, str, str]] = {}
        self._void_ranges: list[tuple[int, int]] = []
        self._part_log: list[tuple[str, dict[str, Any], bytes]] = []
        self._stale: dict[int, dict[str, str]] = {}  # round -> members that sent old parts in it -> why
        self._active: tuple[int, str, tuple[str, ...], tuple[int, ...]] | None = None
        self._banned: dict[str, str] = {}  # peers we caught sending garbage -> why; never grouped with again
        self._round_excluded: dict[str, str] = {}
        self._ef = ErrorFeedback(numel) if spec.error_feedback and spec.compression == "int8" else None

    def start(self) -> P2PAverager:
        self.me = self.dht.peer_id

        async def _register() -> None:
            self._arrived = asyncio.Event()
            await self.dht.p2p.add_binary_stream_handler(self.handler_name, self._handle)

        self.dht.run(_register(), timeout=10)
        return self

    # ---- synchronous entry ----------------------------------------------------------------------

    def average(self, round_: int, base_hash: str, delta: torch.Tensor) -> AverageResult:
        budget = self.spec.matchmaking_timeout * 2 + self.spec.allreduce_timeout + 10
        try:
            return self.dht.run(self._average(round_, base_hash, delta), timeout=budget)
        except RoundFailed:
            raise
        except Exception as e:  # the round is void whatever went wrong; say what it was
            raise RoundFailed(f"{type(e).__name__}: {e}"[:300]) from None

    async def _average(self, round_: int, base: str, delta: torch.Tensor) -> AverageResult:
        t0 = time.monotonic()
        self._enter_round(round_)
        view = self._view(round_, base)
        try:
            # published alongside the window, not before it: a slow DHT store must not keep us from
            # answering (and adopting) a group that the others already decided and wait for
            announce = asyncio.create_task(self._announce_ready(round_, base))
            try:
                order = await self._matchmake(view)
            finally:
                announce.cancel()  # decided or failed: no more store retries for this round
            t1 = time.monotonic()
            self.faults.fire("after_matchmaking", round_)
            averaged = await self._allreduce(round_, base, order, delta)
        except BaseException:
            view.abandoned = True  # tell peers that still ask: we are out of this round
            raise
        sent, received = self._bytes[round_]
        return AverageResult(averaged, order, sent, received,
                             {"matchmaking_s": t1 - t0, "allreduce_s": time.monotonic() - t1}, self._round_excluded,
                             tuple(self._void_ranges))

    def _enter_round(self, round_: int) -> None:
        self.current_round = round_
        self._round_excluded = {}
        self._void_ranges = []
        for keyed in (self._inbox, self._invalid, self._excluded, self._commits, self._claims, self._verdicts,
                      self._stale):  # state of earlier rounds
            _drop_rounds_before(keyed, round_)
        for later in (self._evidence, self._views, self._bytes, self._groups_seen):  # kept one round longer
            _drop_rounds_before(later, round_ - 1)

    def _parts_from(self, view: View) -> set[str]:
        return {sender for r, _, kind, _, sender in self._inbox
                if r == view.round and kind == "part" and sender in view.members and sender != self.me
                and sender not in self._banned}

    def _view(self, round_: int, base: str) -> View:
        view = self._views.get(round_)
        if view is None or view.base != base:
            view = self._views[round_] = View(round_, base, self.me)
        return view

    # ---- transport ------------------------------------------------------------------------------

    def _header(self, kind: str, round_: int, base: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "run": self.spec_hash, "round": round_, "base": base, **fields}

    async def _request(self, peer: str, header: dict[str, Any], body: bytes, round_: int,
                       deadline: float | None = None, max_reply_body: int = 0) -> tuple[dict[str, Any], bytes]:
        timeout = IO_TIMEOUT if deadline is None else max(0.1, deadline - time.monotonic())
        reply_header, reply_body, sent = await transport.request(
            self.dht.p2p, peer, self.handler_name, header, body, timeout, max_reply_body)
        self._bytes[round_][0] += sent
        return reply_header, reply_body

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = stream_info.peer_id.to_base58()
        header: dict[str, Any] = {"round": 0, "base": "0" * 64}
        reply_body = b""
        try:
            header, body = await read_frame(reader, IO_TIMEOUT + self.spec.allreduce_timeout, self.max_body)
            if header["run"] != self.spec_hash:
                raise ProtocolError("message for another run spec")
            round_ = header["round"]
            if not (self.current_round - 1 <= round_ <= self.current_round + 1):
                raise ProtocolError(f"round {round_} is not current ({self.current_round})")
            self._bytes[round_][1] += len(body) + 64
            if header["type"] == "view":
                reply = self._on_view(sender, header)
            elif header["type"] == "evidence_req":
                reply, reply_body = self._on_evidence(header)
            elif header["type"] == "audit":
                self._on_verdict(sender, header)
                reply = self._header("ack", round_, header["base"], ok=True, reason="")
            elif header["type"] in ("part", "result"):
                self._on_payload(sender, header, body)
                reply = self._header("ack", round_, header["base"], ok=True, reason="")
            else:
                raise ProtocolError(f"unexpected message type {header['type']}")
        except (ProtocolError, CodecError) as e:
            reply = self._header("ack", header["round"], header["base"], ok=False, reason=str(e)[:200])
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            writer.close()
            return
        except Exception as e:  # a bug here must not silently drop the stream: answer, and say what it was
            logger.exception("averaging handler failed on a message from %s", sender)
            reply = self._header("ack", header["round"], header["base"], ok=False,
                                 reason=f"internal error: {type(e).__name__}")
        await transport.reply(writer, reply, reply_body)

    def _on_payload(self, sender: str, header: dict[str, Any], body: bytes) -> None:
        round_, gh, kind, shard, size = header["round"], header["group"], header["type"], header["shard"], header["size"]
        if round_ < self.current_round:
            # An honest member of our current group finished that round (with every delivery) before it
            # could join this one: an old part from it now is a replay. Its part is left out this round.
            if kind == "part":
                self._stale.setdefault(self.current_round, {})[sender] = (
                    f"replayed its part of round {round_} in round {self.current_round}")
                self._mark_stale(self.current_round)
            raise ProtocolError(f"round {round_} is over")
        if not 1 <= size or shard >= size:
            raise ProtocolError("shard index out of range")
        seen = self._groups_seen[round_]
        if gh not in seen and len(seen) >= MAX_GROUPS_PER_ROUND:
            raise ProtocolError("too many groups for one round")
        s, e = shard_bounds(self.numel, size)[shard]
        if len(body) != self.codec.encoded_nbytes(e - s):
            why = f"{kind} for shard {shard} has {len(body)} bytes, expected {self.codec.encoded_nbytes(e - s)}"
            if kind == "part":  # mark it, so that the reducer does not wait for it until the deadline
                seen.add(gh)
                self._invalid[(round_, gh, shard, sender)] = why
                assert self._arrived is not None
                self._arrived.set()
            raise ProtocolError(why)
        if kind == "result":
            self._excluded[(round_, gh, shard)] = header["excluded"]
            self._commits[(round_, gh, shard)] = header["parts"]
            self._claims[(round_, gh, shard)] = header["probation"]
        key = (round_, gh, kind, shard, sender)
        if key in self._inbox:
            if self._inbox[key] == body:
                raise ProtocolError(DUPLICATE)  # the sender retried after losing our ack: already have it
            raise ProtocolError(f"a different {kind} for the same shard")
        seen.add(gh)
        self._inbox[key] = body
        assert self._arrived is not None
        self._arrived.set()

    def _on_verdict(self, sender: str, header: dict[str, Any]) -> None:
        """Stores an auditor's verdict; whether ``sender`` audits that shard is checked when it is read."""
        round_, gh, shard = header["round"], header["group"], header["shard"]
        if shard >= header["size"]:
            raise ProtocolError("shard index out of range")
        if gh not in self._groups_seen[round_]:
            raise ProtocolError("verdict for a group we have no messages of")
        key = (round_, gh, shard, sender)
        verdict = (header["ok"], header["result"], header["reason"])
        if key in self._verdicts:
            raise ProtocolError(DUPLICATE if self._verdicts[key] == verdict else "a different verdict for the same shard")
        self._verdicts[key] = verdict
        assert self._arrived is not None
        self._arrived.set()


def _drop_rounds_before(keyed: dict[Any, Any], round_: int) -> None:
    """Deletes the entries of rounds before ``round_``; keys are a round or a tuple starting with one."""
    for key in [k for k in keyed if (k[0] if isinstance(k, tuple) else k) < round_]:
        del keyed[key]
