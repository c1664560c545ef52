"""The all-reduce half of ``P2PAverager``: reduce-scatter, all-gather and the audit of every shard.

For a decided group ``order`` (n members) of round r:

1. every member encodes its slice of shard k and sends it to member k (the reducer) and to member
   k + 1 mod n (the auditor of shard k, when the run audits);
2. reducer k validates and combines the parts of shard k (peer/reduce.py), sends the re-encoded
   result with the digests of the parts it used to every member;
3. auditor k + 1 recomputes shard k from its own copies and sends its verdict, with the hash of the
   result it checked, to every member;
4. members check any "wrong aggregate" accusation themselves on the auditor's evidence
   (peer/disputes.py) and drop whoever is at fault;
5. every member applies each shard whose verdict is positive and whose result is the one the
   auditor checked; a shard its auditor rejects is void for the round (those parameters and their
   momentum keep their values); a result that differs from the audited one voids our whole round.

All members that complete the round apply the same bytes. A member that fails anywhere raises
RoundFailed at the deadline at the latest, like the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from hivetrain.kernels.error_feedback import ErrorFeedback
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging.api import group_hash, shard_bounds
from hivetrain.peer.averaging.disputes import Disputes
from hivetrain.peer.averaging.reduce import (
    WRONG_AGGREGATE,
    audit_shard,
    probation_claims,
    reduce_shard,
    result_hash,
)
from hivetrain.peer.averaging.sybil import Probation
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.faults import ATTACKS, FaultPlan, attack_part, attack_result

logger = logging.getLogger(__name__)
SEND_ATTEMPTS = 3  # deliveries of one message, within the all-reduce deadline
AUDIT_GRACE = 0.25  # share of the deadline an auditor keeps to send its verdict when parts are missing


class AllReduce(Disputes):
    """Mixin: the attributes below are set by ``P2PAverager.__init__``."""

    me: str
    spec: Any
    numel: int
    codec: Codec
    faults: FaultPlan
    _inbox: dict[tuple[int, str, str, int, str], bytes]
    _invalid: dict[tuple[int, str, int, str], str]
    _excluded: dict[tuple[int, str, int], list[str]]
    _commits: dict[tuple[int, str, int], list[str]]  # (round, group, shard) -> the reducer's part digests
    _claims: dict[tuple[int, str, int], list[str]]  # (round, group, shard) -> the reducer's probation claims
    _probation: Probation
    _verdicts: dict[tuple[int, str, int, str], tuple[bool, str, str]]  # (round, group, shard, auditor) -> verdict
    _banned: dict[str, str]
    _round_excluded: dict[str, str]
    _void_ranges: list[tuple[int, int]]
    _stale: dict[int, dict[str, str]]
    _active: tuple[int, str, tuple[str, ...], tuple[int, ...]] | None  # round, group, order, shards we receive
    _part_log: list[tuple[str, dict[str, Any], bytes]]  # our last round's part messages (for the replay test hook)
    _ef: ErrorFeedback | None
    _arrived: asyncio.Event | None

    async def _allreduce(self, round_: int, base: str, order: tuple[str, ...], delta: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + self.spec.allreduce_timeout
        try:
            averaged, excluded = await self._reduce_scatter_gather(round_, base, order, delta, deadline)
            self._round_excluded = excluded
            self._probation.record_completed(round_, order)
            if self._ef is not None:
                self._ef.commit()
            return averaged
        except RoundFailed as e:
            if self._ef is not None:
                self._ef.discard()
            # The others of the group void this round at the deadline at the latest; leaving earlier
            # would put us alone into the next round's matchmaking. Void together, start together.
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            raise RoundFailed(str(e), {**self._round_excluded, **e.excluded}) from None

    def _audits(self, n: int) -> bool:
        return bool(self.spec.audit) and n >= 2

    async def _reduce_scatter_gather(self, round_: int, base: str, order: tuple[str, ...], delta: torch.Tensor,
                                     deadline: float) -> tuple[torch.Tensor, dict[str, str]]:
        gh = group_hash(order, round_, base)
        n = len(order)
        bounds = shard_bounds(self.numel, n)
        mine = order.index(self.me)
        audited = (mine - 1) % n if self._audits(n) else None  # the shard we audit
        self._active = (round_, gh, order, (mine,) if audited is None else (mine, audited))
        self._mark_stale(round_)
        loop = asyncio.get_running_loop()
        parts = await loop.run_in_executor(None, self._encode_parts, delta, bounds)
        if self.faults.action in ATTACKS and self.faults.active("parts", round_):  # test hook: a Byzantine member
            parts = [attack_part(self.faults.action, part, delta[s:e], self.codec)
                     for part, (s, e) in zip(parts, bounds, strict=True)]
        self._inbox[(round_, gh, "part", mine, self.me)] = parts[mine]
        sends = [(k, k, parts[k]) for k in range(n) if k != mine]
        if audited is not None:
            self._inbox[(round_, gh, "part", audited, self.me)] = parts[audited]
            sends += [((k + 1) % n, k, parts[k]) for k in range(n) if (k + 1) % n != mine]
        self.faults.fire("before_parts", round_)
        if self.faults.action == "replay" and self.faults.active("parts", round_):  # test hook: a replaying member
            await self._replay_last_parts(deadline)
        else:
            await self._send_all(round_, base, gh, "part", order, sends, deadline, strict=True)
        self.faults.fire("after_parts", round_)

        await self._wait_for(lambda: self._have_parts(round_, gh, mine, order), deadline, f"parts of shard {mine}")
        s, e = bounds[mine]
        received, invalid = self._parts_of(round_, gh, mine, order)
        claims = probation_claims(order, {p for p in order if p != self.me and self._probation.on_probation(p, round_)})
        shard = await loop.run_in_executor(None, reduce_shard, received, invalid, order, e - s, self.codec,
                                           self.spec.aggregation, claims)
        for peer, why in shard.excluded.items():
            self._banned[peer] = f"round {round_}: {why}"  # seen by us: never in our groups again
        self._round_excluded.update(shard.excluded)
        result = shard.result
        if self.faults.action == "wrongsum" and self.faults.active("results", round_):  # test hook: a cheating reducer
            result = attack_result(result, e - s, self.codec)
        self._inbox[(round_, gh, "result", mine, self.me)] = result
        self._excluded[(round_, gh, mine)] = sorted(shard.excluded)
        self._commits[(round_, gh, mine)] = shard.digests
        self._claims[(round_, gh, mine)] = shard.probation
        self.faults.fire("before_results", round_)
        await self._send_all(round_, base, gh, "result", order, [(k, mine, result) for k in range(n) if k != mine],
                             deadline, strict=False, excluded=sorted(shard.excluded), parts=shard.digests,
                             probation=shard.probation)
        await self._wait_for(lambda: all((round_, gh, "result", k, p) in self._inbox for k, p in enumerate(order)),
                             deadline, "results of every shard")
        if audited is not None:
            await self._audit(round_, base, gh, order, audited, deadline)
            await self._wait_for(lambda: all((round_, gh, k, order[(k + 1) % n]) in self._verdicts for k in range(n)),
                                 deadline, "audit verdicts of every shard")
        averaged, excluded = self._gather(round_, gh, order, bounds)
        if audited is not None:
            await self._settle_accusations(round_, base, gh, order)
            excluded.update(self._round_excluded)
        return averaged, excluded

    def _mark_stale(self, round_: int) -> None:
        """Leaves out, in the shards we reduce or audit this round, members that replayed old parts."""
        if self._active is None or self._active[0] != round_:
            return
        _, gh, order, shards = self._active
        for peer, why in self._stale.get(round_, {}).items():
            if peer in order:
                for shard in shards:
                    self._invalid.setdefault((round_, gh, shard, peer), why)
        assert self._arrived is not None
        self._arrived.set()

    async def _replay_last_parts(self, deadline: float) -> None:
        """Test hook: sends our previous round's part messages again, verbatim, instead of this round's."""
        for peer, header, body in self._part_log:
            try:
                await self._request(peer, header, body, self._active[0] if self._active else 0, deadline)
            except Exception as e:
                logger.info("replay to %s: %r", peer, e)

    def _have_parts(self, round_: int, gh: str, shard: int, order: tuple[str, ...]) -> bool:
        return all((round_, gh, "part", shard, p) in self._inbox or (round_, gh, shard, p) in self._invalid
                   for p in order)

    def _parts_of(self, round_: int, gh: str, shard: int,
                  order: tuple[str, ...]) -> tuple[dict[str, bytes], dict[str, str]]:
        received = {p: self._inbox[(round_, gh, "part", shard, p)] for p in order
                    if (round_, gh, "part", shard, p) in self._inbox}
        invalid = {p: self._invalid[(round_, gh, shard, p)] for p in order if (round_, gh, shard, p) in self._invalid}
        return received, invalid

    async def _audit(self, round_: int, base: str, gh: str, order: tuple[str, ...], shard: int, deadline: float) -> None:
        """Checks shard ``shard`` of ``order[shard]`` and tells every member the verdict."""
        n = len(order)
        grace = AUDIT_GRACE * self.spec.allreduce_timeout
        try:  # a member may withhold our copy: then the shard is unverifiable, not the round lost
            await self._wait_for(lambda: self._have_parts(round_, gh, shard, order), deadline - grace, "audit copies")
        except RoundFailed:
            pass
        result = self._inbox[(round_, gh, "result", shard, order[shard])]
        received, invalid = self._parts_of(round_, gh, shard, order)
        missing = [p for p in order if p not in received and p not in invalid]
        s, e = shard_bounds(self.numel, n)[shard]
        if missing:
            why: str | None = f"unverifiable: no part from {', '.join(missing)} reached the auditor"[:300]
        else:
            commits = self._commits.get((round_, gh, shard), [])
            claims = self._claims.get((round_, gh, shard), [])
            why = await asyncio.get_running_loop().run_in_executor(
                None, audit_shard, result, commits, received, invalid, order, e - s, self.codec, self.spec.aggregation,
                claims)
        if self.faults.action == "accuse" and self.faults.active("results", round_):  # test hook: a lying auditor
            why = f"{WRONG_AGGREGATE}: (test hook) a false accusation"
        if why is not None:
            logger.warning("round %d: audit of shard %d (reducer %s): %s", round_, shard, order[shard], why)
            if why.startswith(WRONG_AGGREGATE):
                self._banned[order[shard]] = f"round {round_}: {why}"
                self._keep_evidence(round_, gh, order, shard)
        digest = result_hash(result)
        self._verdicts[(round_, gh, shard, self.me)] = (why is None, digest, why or "")
        await self._send_all(round_, base, gh, "audit", order, [(k, shard, b"") for k in range(n) if k != order.index(self.me)],
                             deadline, strict=False, ok=why is None, result=digest, reason=(why or "")[:290])

    def _gather(self, round_: int, gh: str, order: tuple[str, ...],
                bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, dict[str, str]]:
        """Decodes every shard's result into one vector; applies the verdicts (see the module doc)."""
        n = len(order)
        averaged = torch.empty(self.numel, dtype=torch.float32)  # (n,) fp32
        void: dict[str, str] = {}
        self._void_ranges = []
        for k, (s, e) in enumerate(bounds):
            body = self._inbox[(round_, gh, "result", k, order[k])]
            if self._audits(n):
                auditor = order[(k + 1) % n]
                ok, digest, why = self._verdicts[(round_, gh, k, auditor)]
                if not ok:
                    averaged[s:e] = 0.0
                    self._void_ranges.append((s, e))
                    void[order[k]] = f"shard {k} void: its auditor {auditor} found it {why}"[:300]
                    continue
                if digest != result_hash(body):
                    raise RoundFailed(f"our result of shard {k} from {order[k]} is not the one its auditor checked")
            try:
                averaged[s:e] = self.codec.decode(body, e - s)
            except CodecError as err:
                raise RoundFailed(f"the result of shard {k} from {order[k]} is malformed: {err}") from None
        if len(self._void_ranges) == n:
            raise RoundFailed("every shard of the round failed its audit", void)
        reported = {p: f"on probation (weight 0) in shard {k}" for k in range(n)
                    for p in self._claims.get((round_, gh, k), [])}
        reported.update({p: f"left out of shard {k} by {order[k]}" for k in range(n)
                         for p in self._excluded.get((round_, gh, k), [])})
        return averaged, {**reported, **void, **self._round_excluded}

    def _encode_parts(self, delta: torch.Tensor, bounds: list[tuple[int, int]]) -> list[bytes]:
        """Encodes our slice for every shard (with error feedback if the run uses it); worker thread."""
        source = self._ef.compensate(delta) if self._ef is not None else delta  # (n,) fp32
        parts = [self.codec.encode(source[s:e].contiguous()) for s, e in bounds]
        if self._ef is not None:
            sent = torch.cat([self.codec.decode(part, e - s) for part, (s, e) in zip(parts, bounds, strict=True)])
            self._ef.sent(source, sent)
        return parts

    async def _send_all(self, round_: int, base: str, gh: str, kind: str, order: tuple[str, ...],
                        sends: list[tuple[int, int, bytes]], deadline: float, strict: bool, **extra: Any) -> None:
        """Sends each (member index, shard, body) of ``sends`` as a ``kind`` message."""

        if kind == "part":
            self._part_log = []

        async def send(k: int, shard: int, body: bytes) -> None:
            header = self._header(kind, round_, base, group=gh, shard=shard, size=len(order), **extra)
            if kind == "part":
                self._part_log.append((order[k], header, body))
            for attempt in range(SEND_ATTEMPTS):
                try:
                    ack, _ = await self._request(order[k], header, body, round_, deadline)
                except Exception as e:  # a lost stream or a dial error: try again while the deadline allows
                    if attempt + 1 == SEND_ATTEMPTS or time.monotonic() + 0.5 >= deadline:
                        raise RoundFailed(f"could not deliver our {kind} to {order[k]}: {e!r}"[:300]) from None
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                if ack.get("ok", False) or ack.get("reason") == DUPLICATE:  # a retry of a delivered message
                    return
                raise RoundFailed(f"{order[k]} refused our {kind}: {ack.get('reason', '')}")

        results = await asyncio.gather(*(send(*s) for s in sends), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and strict:
            raise RoundFailed(f"could not deliver {kind}s: {errors[0]!r}"[:300])
        for err in errors:  # a member that cannot get our message voids its own round; we can still finish
            logger.info("round %d: %s delivery failed: %r", round_, kind, err)

    async def _wait_for(self, ready: Any, deadline: float, what: str) -> None:
        assert self._arrived is not None
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RoundFailed(f"deadline passed waiting for the {what}")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                pass


DUPLICATE = "duplicate"
