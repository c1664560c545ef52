"""The cross-group stage: one state per round for the whole run, however many groups it has.

Groups reduce their members' parts as before (robust, audited). With ``spec.cross_groups`` every
round's vector is cut into the same U shards in every group (``units``: a full group's layout,
dealt among any group's reducers by their claims), and shard k is cut again into S sub-pieces
(``Plan.subs``). Each sub-piece (k, j) has a *designee*: the peer that averages it across groups.

Designees are derived, never chosen: every peer reads the round's ready board once it has settled
(``read_plan``): the peers ready at our base within DESIGNATE_WINDOW seconds of the earliest ready
record, that can be dialed, are the round's designees; the designee of (k, j) is the first of them
by weighted rendezvous hashing of (round, base, k, j) (weights: their uplink claims, so a slow peer
is designated less), the second and third take over when it cannot be reached. S is chosen so that
the U x S sub-pieces are about as many as the designees: each designee averages about one, and a
designee's cost is about one vector's bytes in and out, whatever the run's size.

1. The reducer of shard k in each group, once its auditor approved the result (or rejected it:
   then the group's weight is 0), sends each sub-piece of its result with the group's members and
   weight (members whose parts it used) to the sub-piece's designee (a ``cross`` request).
2. The designee (``Desk``) waits until the groups it received cover every peer in the round: ready
   at our base by the round's *cutoff* (the earliest ready record + ``matchmaking_timeout``, the
   grace any straggler gets), less the peers whose round failed (they publish their ready record
   again with ``out`` and their group: a peer two of them name is out too). It waits at most
   LONG_WAIT x ``allreduce_timeout`` past the first arrival (a group that died), then computes the
   weighted mean of the groups' sub-pieces in a fixed order (by group hash) and encodes it once:
   one set of bytes, signed, sent back to every reducer that sent it (``cross_out``). A group that
   arrives later is refused: it applies its own values (the run forks there; fork choice re-syncs
   it at the next boundary).
3. Each reducer forwards the signed sub-pieces of its shards to its members. Every member checks the
   signature against the designees it derived itself and applies exactly those bytes, so every
   peer that completes the round holds the same state. A member that misses one voids the round
   (and re-syncs at the next boundary, like any void round); a sub-piece no group contributed to is
   void everywhere (its values and momentum keep their values).

Known limits (SECURITY.md): the designee's mean is not audited yet, group weights are the group's
own claim (at most the group's size), and an attacker that stores a backdated ready record late can
make honest peers derive different designees (their rounds then fork; fork choice resolves it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.dht import clock
from hivetrain.dht.records import bucket_of
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging import rates
from hivetrain.peer.averaging.api import pieces_per_member, shard_bounds
from hivetrain.peer.averaging.context import PeerContext
from hivetrain.peer.averaging.delivery import send_all
from hivetrain.peer.averaging.ready import Ready, ReadyBoard
from hivetrain.peer.averaging.statements import valid
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.wire import MAX_GROUP, MAX_PIECES, ZERO, Code

logger = logging.getLogger(__name__)
DESIGNATE_WINDOW = 1.0  # s after the earliest ready record: peers ready by then are the round's designees ...
SETTLE = 1.0  # s more before the designees are read (a record stored by then is on every reader's board)
# (each at most a quarter of the run's matchmaking_timeout: ``windows``)
MAX_SUBS = 64  # sub-pieces per shard
MIN_SUB_VALUES = 1024  # values per sub-piece, at least (below, the messages cost more than they carry)
RANKS = 3  # designees per sub-piece: the first, and who takes over when it cannot be reached
MAX_DESIGNEES = 4096  # ready records a plan reads
MAX_CROSS_GROUPS = 256  # group results one sub-piece takes (one per group)
MAX_EARLY_WORDS = 2 * MAX_CROSS_GROUPS  # words held per sub-piece before their groups' sub-pieces arrive
POLL = 0.5  # s between board reads while a designee waits for groups
LONG_WAIT = 0.25  # x allreduce_timeout past a sub-piece's first group: the most its designee waits for the others
_CROSS = b"hivetrain-cross-v1\0"
VOID = "0" * 64  # the result hash of a sub-piece no group contributed to


def units(numel: int, target: int, piece_values: int) -> int:
    """Shards of a round with the cross-group stage: a full group's layout, the same in every group."""
    return min(MAX_PIECES, target * pieces_per_member(numel, target, piece_values))


def windows(matchmaking_timeout: float) -> tuple[float, float]:
    """(designate window, settle) seconds for a run."""
    return min(DESIGNATE_WINDOW, matchmaking_timeout / 4), min(SETTLE, matchmaking_timeout / 4)


def round_id(run: str, round_: int, base: str) -> str:
    """What stands for the group in the applied digest when every group applies the same means."""
    return hashlib.sha256(f"cross/{run}/{round_}/{base}".encode()).hexdigest()


def cross_codec(codec: Codec) -> Codec:
    """How a designee encodes its mean: the codec reducers use for the largest group."""
    return codec.for_results(MAX_GROUP)


@dataclass(frozen=True)
class Plan:
    """Round r's designees, as one peer derived them from its board."""

    round: int
    base: str
    designees: tuple[str, ...]  # sorted
    weights: dict[str, float]
    units: int  # shards of the round (U)
    numel: int
    t0: float = 0.0  # unix time of the earliest ready record at the base: the round's cutoff counts from it
    ready: frozenset[str] = frozenset()  # every peer ready at the base when the plan was read (all buckets)

    @property
    def subs(self) -> int:
        """Sub-pieces per shard: the U x S sub-pieces about as many as the designees."""
        shard = -(-self.numel // self.units)
        most = max(1, min(MAX_SUBS, shard // MIN_SUB_VALUES))
        return max(1, min(most, -(-len(self.designees) // self.units)))

    def ranked(self, k: int, j: int) -> list[str]:
        """The designees of sub-piece (k, j), in order (weighted rendezvous hashing)."""
        def score(p: str) -> float:
            h = hashlib.sha256(f"cross/{self.round}/{self.base}/{k}/{j}/{p}".encode()).digest()
            u = (int.from_bytes(h[:8], "big") + 1) / 2.0**64  # (0, 1]
            return -math.log(u) / self.weights[p]

        return sorted(self.designees, key=lambda p: (score(p), p))[:RANKS]

    def sub_bounds(self, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) of each sub-piece of the shard [start, end)."""
        return [(start + a, start + b) for a, b in shard_bounds(end - start, self.subs)]


def derive(records: Sequence[Ready], round_: int, base: str, run: str, units_: int, numel: int,
           window: float = DESIGNATE_WINDOW) -> Plan:
    """The plan from a board's records (pure): see the module doc."""
    ready = [r for r in records if r.done and r.base == base and r.spec == run and r.round == round_]
    if not ready:
        return Plan(round_, base, (), {}, units_, numel, 0.0)
    t0 = min(r.eta for r in ready)
    early = [r for r in ready if r.eta <= t0 + window]
    # nobody dials a closed peer; if every early peer is closed, each can still be its own designee
    chosen = {r.peer_id: r.up for r in early if not r.closed} or {r.peer_id: r.up for r in early}
    weights = rates.weights(sorted(chosen), chosen)  # (unknown: the median; at most 4x it)
    return Plan(round_, base, tuple(sorted(chosen)[:MAX_DESIGNEES]), weights, units_, numel, t0,
                frozenset(sorted({r.peer_id for r in ready})[:MAX_DESIGNEES]))


async def read_plan(board: ReadyBoard, round_: int, base: str, run: str, units_: int, numel: int,
                    own: Ready | None = None, timing: tuple[float, float] = (DESIGNATE_WINDOW, SETTLE),
                    level: int = 0) -> Plan:
    """Reads the board (every bucket of 2^level) until it has settled for the designees (SETTLE past
    the window of the earliest ready record), then derives the plan; ``own``: our record, first-hand
    (it may not be stored yet). RoundFailed if nobody is on it."""
    for _ in range(100):
        records = [r for r in await board.read(round_, level) if own is None or r.peer_id != own.peer_id]
        records += [own] if own is not None else []
        ready = [r for r in records if r.done and r.base == base and r.spec == run]
        if not ready:
            await asyncio.sleep(POLL)
            continue
        settled = min(r.eta for r in ready) + timing[0] + timing[1]
        if clock.wall() < settled:
            await asyncio.sleep(min(settled - clock.wall() + 0.01, 30.0))
            continue
        plan = derive(records, round_, base, run, units_, numel, timing[0])
        if plan.designees:
            return plan
    raise RoundFailed(f"no designees of round {round_} on the board")


def fallen_back(ctx: PeerContext, round_: int, base: str, k: int, j: int, body: bytes, weight: int,
                enc: int) -> tuple[dict[str, Any], bytes]:
    """Our group's own sub-piece, signed by us, its reducer: what the group applies when none of
    the sub-piece's designees took it (they cannot be reached: left, or not peers at all). The
    group then ends the round on its own state for those values, as before the cross stage; fork
    choice settles it at the next boundary."""
    result = hashlib.sha256(body).hexdigest() if body else VOID
    sig = ctx.identity.sign(message(ctx.run, round_, base, k, j, result, weight, 1, enc))
    return ctx.header("cross_out", round_, base, group=ZERO, shard=k, sub=j, result=result, weight=weight, groups=1,
                      enc=enc, signer=ctx.me, sig=sig.hex()), body


def message(run: str, round_: int, base: str, k: int, j: int, result: str, weight: int, groups: int,
            enc: int) -> bytes:
    return _CROSS + f"{run}/{round_}/{base}/{k}/{j}/{result}/{weight}/{groups}/{enc}".encode()


def designated(header: dict[str, Any], plan: Plan, fallback: str = "") -> bool:
    """Whether a ``cross_out``'s signer is, by our plan, one of its sub-piece's designees (or our
    reducer of the shard signing its own result: ``fallback``). Plans come from boards, and two
    honest peers' boards can differ: a signer outside ours is refused, but proves nothing against
    the member that forwarded it."""
    k, j = header["shard"], header["sub"]
    return header["signer"] in plan.ranked(k, j) or (header["signer"] == fallback and header["groups"] <= 1)


def checked(header: dict[str, Any], body: bytes, plan: Plan, fallback: str = "") -> str:
    """Why a ``cross_out`` is not a designee's signed sub-piece ("" if it is). ``fallback``: our
    reducer of the shard, who signs its own result when no designee took it (``fallen_back``)."""
    k, j = header["shard"], header["sub"]
    if k >= plan.units or j >= plan.subs:
        return f"sub-piece ({k}, {j}) does not exist"
    if not designated(header, plan, fallback):
        return f"{header['signer']} is not a designee of sub-piece ({k}, {j})"
    result = hashlib.sha256(body).hexdigest() if body else VOID
    if result != header["result"]:
        return "the sub-piece does not match its hash"
    signed = message(header["run"], header["round"], header["base"], k, j, header["result"], header["weight"],
                     header["groups"], header["enc"])
    if not valid(header["signer"], bytes.fromhex(header["sig"]), signed):
        return "the designee's signature does not verify"
    return ""


@dataclass
class _Entry:
    holder: str  # the reducer that sent it: gets the mean back
    group: str
    members: frozenset[str]
    weight: int
    body: bytes
    enc: int  # encoded with ``codec.for_results(enc)``
    result: str
    attested: bool | None = None  # another member's word on the same bytes (None: not yet)
    attester: str = ""

    def counts(self) -> bool:
        """Whether its values go into the mean: a group of one, or another member approved these bytes."""
        return self.weight > 0 and bool(self.body) and (len(self.members) == 1 or self.attested is True)


@dataclass
class _Unit:
    entries: dict[str, _Entry] = field(default_factory=dict)  # group hash -> its sub-piece
    first: float = 0.0
    out: tuple[dict[str, Any], bytes] | None = None  # the signed mean, once computed
    closed: bool = False
    task: asyncio.Task[None] | None = None
    early: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (group, sender) -> a word
    # that came before its group's sub-piece (the reducer's upload is still on its way): taken when it comes


class Desk:
    """A designee's side of one round: takes ``cross`` requests, averages, sends the means back."""

    def __init__(self, ctx: PeerContext, board: ReadyBoard, round_: int, base: str,
                 local: Callable[[dict[str, Any], bytes], None], own: Callable[[], Ready | None], level: int = 0):
        self.ctx, self.board, self.round, self.base = ctx, board, round_, base
        self.level = level  # the round's ready records are in 2^level buckets (ready.py)
        self.local = local  # delivers a mean to ourselves (we reduced that shard in our own group)
        self.own = own  # our ready record of the round (None: we are not ready for it)
        self.units_ = units(ctx.numel, ctx.spec.target_group_size, ctx.spec.piece_values)
        self.timing = windows(ctx.spec.matchmaking_timeout)
        self.plan: Plan | None = None
        self._planning: asyncio.Future[Plan] | None = None
        self.work: dict[tuple[int, int], _Unit] = {}
        self.waiting: set[str] | None = None  # peers whose groups our means wait for (None: board not read yet)
        self.changed = asyncio.Event()  # set when a group or a word arrives, or ``waiting`` is read anew
        self._poller: asyncio.Task[None] | None = None

    def sub_nbytes(self, k: int, j: int, codec: Codec) -> int:
        plan = self.plan
        assert plan is not None
        start, end = shard_bounds(self.ctx.numel, plan.units)[k]
        a, b = plan.sub_bounds(start, end)[j]
        return codec.encoded_nbytes(b - a)

    async def get_plan(self) -> Plan:
        if self.plan is not None:
            return self.plan
        if self._planning is None:
            self._planning = asyncio.ensure_future(read_plan(self.board, self.round, self.base, self.ctx.run,
                                                             self.units_, self.ctx.numel, self.own(), self.timing,
                                                             self.level))
        self.plan = await asyncio.shield(self._planning)
        return self.plan

    async def accept(self, sender: str, header: dict[str, Any], body: bytes) -> tuple[Code, str]:
        """One group's sub-piece from its reducer, or another member's word on it (a ``cross``
        request, its body read)."""
        try:
            plan = await asyncio.wait_for(self.get_plan(), sum(self.timing) + 5.0)
        except (TimeoutError, RoundFailed) as e:
            return Code.NOT_READY, f"no plan for round {self.round}: {e}"
        k, j = header["shard"], header["sub"]
        if k >= plan.units or j >= plan.subs:
            return Code.MALFORMED, f"sub-piece ({k}, {j}) does not exist"
        if self.ctx.me not in plan.ranked(k, j):
            return Code.WRONG_ROLE, f"we are not a designee of sub-piece ({k}, {j})"
        members = frozenset(header["members"])
        if sender not in members or header["weight"] > len(members) or not 1 <= header["enc"] <= MAX_GROUP:
            return Code.MALFORMED, "the sender is not in the group it names, or the weight exceeds it"
        unit = self.work.setdefault((k, j), _Unit())
        if unit.out is not None or unit.closed:
            return Code.NOT_MEMBER, "the mean of that sub-piece is computed: too late for this round"
        group = header["group"]
        entry = unit.entries.get(group)
        if header["attest"]:
            if body:
                return Code.WRONG_SIZE, "an attestation has no body"
            if entry is None:  # held until the sub-piece comes (a bounded number; past it, asked again)
                if (group, sender) in unit.early:
                    return Code.DUPLICATE, ""
                if len(unit.early) >= MAX_EARLY_WORDS:
                    return Code.NOT_READY, "its reducer's sub-piece has not arrived yet"
                unit.early[(group, sender)] = header
                return Code.OK, ""
            if sender == entry.holder or sender not in entry.members:
                return Code.WRONG_ROLE, "an attestation comes from another member of the group"
            if entry.attested is not None:
                return (Code.DUPLICATE, "") if entry.attester == sender else (Code.DUPLICATE, "attested already")
            self._attest(entry, sender, header)
            return Code.OK, ""
        codec = self.ctx.codec.for_results(header["enc"])
        if body and len(body) != self.sub_nbytes(k, j, codec):
            return Code.WRONG_SIZE, f"sub-piece ({k}, {j}) has {len(body)} bytes"
        if (header["weight"] > 0) != bool(body) or (hashlib.sha256(body).hexdigest() if body else VOID) != header["result"]:
            return Code.MALFORMED, "a weight without values, or values that do not match their hash"
        if entry is not None:
            same = entry.body == body and entry.holder == sender
            return (Code.DUPLICATE, "") if same else (Code.EQUIVOCATION, "another sub-piece for that group")
        if len(unit.entries) >= MAX_CROSS_GROUPS:
            return Code.BUSY, "too many groups for one sub-piece"
        banned = sender in self.ctx.bans  # we caught its reducer misbehaving: its group gets the means, without its values
        entry = unit.entries[group] = _Entry(sender, group, members, 0 if banned else header["weight"],
                                             b"" if banned else body, header["enc"], header["result"])
        for (g, attester), word in list(unit.early.items()):  # the first word held for it from another member
            if g == group:
                del unit.early[(g, attester)]
                if entry.attested is None and attester != sender and attester in members:
                    self._attest(entry, attester, word)
        if unit.task is None:
            unit.first = clock.now()
            unit.task = asyncio.ensure_future(self._finish(k, j, unit))
        self._watch()
        self.changed.set()
        return Code.OK, ""

    def _attest(self, entry: _Entry, sender: str, header: dict[str, Any]) -> None:
        """Another member's word on ``entry``: approved if it names the same bytes, group and weight."""
        same = (header["result"], frozenset(header["members"])) == (entry.result, entry.members) and \
            (header["weight"] == entry.weight or entry.weight == 0)
        entry.attested, entry.attester = bool(header["ok"]) and same, sender
        self.changed.set()

    def _watch(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Who is on the round's board: the peers our means should wait for. Every bucket is read
        until the cutoff has settled (a peer may still become ready in any of them); after it, only
        the buckets of peers whose groups have yet to arrive (whose records can still say ``out``:
        a group, derived within one bucket, says so in its own)."""
        held: dict[int, list[Ready]] = {}  # bucket -> its records, as last read
        while any(u.out is None and not u.closed for u in self.work.values()):
            buckets: list[int] | None = None
            if held and self.waiting is not None and self.plan is not None and \
                    clock.wall() >= self.plan.t0 + self.ctx.spec.matchmaking_timeout + self.timing[1]:
                missing = set().union(*(self.waiting - set().union(*(e.members for e in u.entries.values()))
                                        for u in self.work.values() if u.out is None and not u.closed))
                buckets = sorted({bucket_of(self.round, p, self.level) for p in missing})
            try:
                records = await self.board.read(self.round, self.level, buckets) if buckets != [] else []
            except Exception as e:
                logger.debug("round %d: board read failed: %r", self.round, e)
                records = []
            fresh: dict[int, list[Ready]] = {}
            for r in records:
                fresh.setdefault(bucket_of(self.round, r.peer_id, self.level), []).append(r)
            held.update(fresh)  # (a bucket whose read failed keeps what we had)
            if held:
                self.waiting = self.waited([r for rs in held.values() for r in rs])
                self.changed.set()
            await asyncio.sleep(POLL)

    def waited(self, records: Sequence[Ready]) -> set[str]:
        """The peers in the round, from the board: ready at our base by the round's cutoff (the
        earliest ready record + ``matchmaking_timeout``, the grace any straggler gets) and, until
        the cutoff has settled, those that announced it and are not ready elsewhere; less those
        whose round failed (``out``: they said so, and named their group). A peer ready later is
        late: a group of late peers that arrives before the means are computed is in them, the
        means never wait for one."""
        assert self.plan is not None
        cutoff = self.plan.t0 + self.ctx.spec.matchmaking_timeout
        records = [r for r in records if r.spec == self.ctx.run][:MAX_DESIGNEES]
        elsewhere = {r.peer_id for r in records if r.done and r.base != self.base}
        failed = [r for r in records if r.out and r.base == self.base]
        named = Counter(p for r in failed for p in set(r.group[:MAX_GROUP]) - {r.peer_id})
        # (a peer that died in a failed group says nothing; its group says it for it: two of them, so that
        # one identity cannot name honest peers to hurry the means past their groups)
        out = {r.peer_id for r in failed} | {p for p, n in named.items() if n >= 2}
        waited = {r.peer_id for r in records if r.done and r.base == self.base and r.eta <= cutoff}
        if clock.wall() < cutoff + self.timing[1]:
            waited |= {r.peer_id for r in records
                       if not r.done and r.base in (self.base, ZERO) and r.peer_id not in elsewhere}
        return waited - out

    async def _finish(self, k: int, j: int, unit: _Unit) -> None:
        """Computes the sub-piece's mean once the groups of every peer in the round (``waited``)
        arrived and were vouched for, or LONG_WAIT x ``allreduce_timeout`` past the first arrival
        (a group that died in the cross stage: the others go on without it)."""
        patience = LONG_WAIT * self.ctx.spec.allreduce_timeout
        try:
            while unit.first + patience - clock.now() > clock.EPSILON:
                covered = set().union(*(e.members for e in unit.entries.values()))
                attested = all(e.attested is not None or len(e.members) == 1 or e.weight == 0
                               for e in unit.entries.values())
                if self.waiting is not None and self.waiting <= covered and attested:
                    break
                self.changed.clear()  # (every unit's task clears it: each then looks again within POLL / 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(),
                                           min(POLL / 2, max(0.0, unit.first + patience - clock.now())))
            unit.closed = True
            header, body = await asyncio.to_thread(self._mean, k, j, list(unit.entries.values()))
            unit.out = (header, body)
            sends = []
            for e in unit.entries.values():
                if e.holder == self.ctx.me:
                    self.local(header, body)
                else:  # (a mean that is the holder's own bytes goes back without them: it has them)
                    sends.append((e.holder, dict(header, group=e.group), b"" if body and body == e.body else body))
            deadline = clock.now() + self.ctx.spec.allreduce_timeout
            await send_all(self.ctx, self.round, deadline, sends, strict=False)
        except Exception as e:  # a background task: say what went wrong, never raise unseen
            logger.warning("round %d: the mean of sub-piece (%d, %d) failed: %r", self.round, k, j, e)

    def _mean(self, k: int, j: int, entries: list[_Entry]) -> tuple[dict[str, Any], bytes]:
        """The weighted mean of the groups' sub-pieces, in group-hash order, encoded once (worker thread)."""
        plan = self.plan
        assert plan is not None
        start, end = shard_bounds(self.ctx.numel, plan.units)[k]
        a, b = plan.sub_bounds(start, end)[j]
        counted = [e for e in sorted(entries, key=lambda e: e.group) if e.counts()]
        if len(counted) == 1:  # one group's values: its own bytes, as its reducer encoded them
            e = counted[0]
            return self._signed(k, j, e.body, e.weight, 1, e.enc)
        acc = torch.zeros(b - a, dtype=torch.float32)  # (b - a,) fp32
        total = groups = 0
        for e in counted:
            try:
                values = self.ctx.codec.for_results(e.enc).decode(e.body, b - a)
            except CodecError as err:
                logger.warning("round %d: the sub-piece (%d, %d) of group %s is malformed: %s", self.round, k, j,
                               e.group[:12], err)
                continue
            acc.add_(values * float(e.weight))
            total += e.weight
            groups += 1
        body = cross_codec(self.ctx.codec).encode(acc / float(total)) if total else b""
        return self._signed(k, j, body, total, groups, MAX_GROUP)

    def _signed(self, k: int, j: int, body: bytes, weight: int, groups: int, enc: int) -> tuple[dict[str, Any], bytes]:
        result = hashlib.sha256(body).hexdigest() if body else VOID
        sig = self.ctx.identity.sign(message(self.ctx.run, self.round, self.base, k, j, result, weight, groups, enc))
        header = self.ctx.header("cross_out", self.round, self.base, group=ZERO, shard=k, sub=j, result=result,
                                 weight=weight, groups=groups, enc=enc, signer=self.ctx.me, sig=sig.hex())
        return header, body

    def stop(self) -> None:
        for task in [self._poller, self._planning, *(u.task for u in self.work.values())]:
            if task is not None and not task.done():
                task.cancel()
