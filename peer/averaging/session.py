"""One round's all-reduce state for one group we derived: ``RoundSession``, with one ``ShardState`` per shard.

The vector is cut into n x P contiguous shards ("pieces", P per member, sized by the run's
``piece_values``), n counting the reducers: the members that can be dialed and are not too slow
(peer/averaging/rates.py). Closed (outbound-only) and slow members send their parts and receive
results and verdicts, and reduce and audit nothing. Shards are dealt to the reducers in proportion
to the uplink each claimed (with equal claims: reducer k mod n reduces shard k), and the auditor of
a shard is the reducer of the next shard that another reducer reduces. Every slot below is per shard.

A session exists only for a group this peer decided itself (peer/averaging/matchmaking.py), so
every message it accepts comes from a member, and each slot takes one message from the one member
whose role it is:

- a part of shard k: from any member, and only if we reduce or audit k; exactly the shard's size;
  a slow member (``relayed``) sends its part only to the reducer, signed, and only a ``pledge`` (the
  part's digest) to the auditor: the reducer ``relay``s the part with the member's signature to the
  auditor, so a slow uplink carries the vector once, not twice. The reducer cannot alter the copy
  (the signature), nor drop it unseen (the pledge: a part pledged and not relayed leaves the shard
  unverifiable, as copies that differ do); a member whose pledge and signed part differ is caught;
- the result of shard k: from its reducer only, signed by it (peer/averaging/statements.py);
- the verdict on shard k: from its auditor only, signed by it;
- an ``applied`` report (a digest, no body): from each member once.

Sizes are checked on the header, before a body is read; a slot is reserved while its body is read.
The same message again is a DUPLICATE (a retry after a lost ack); a different one in a filled slot
is an EQUIVOCATION, attributed to its sender. The session, with everything in it, is dropped when
its round is over (the averager keeps the previous round's for evidence requests).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hivetrain.dht import clock
from hivetrain.kernels.errors import CodecError
from hivetrain.kernels.int8 import Codec
from hivetrain.peer.averaging import rates
from hivetrain.peer.averaging.api import group_hash, pieces_per_member, shard_bounds
from hivetrain.peer.averaging.cross import (
    MAX_SUBS,
    MEAN_BOUND,
    MIN_SUB_VALUES,
    VOID,
    Plan,
    checked,
    cross_codec,
    designated,
    off,
)
from hivetrain.peer.averaging.reduce import digest
from hivetrain.peer.averaging.statements import (
    STATEMENT_LEN,
    Statement,
    Where,
    commitment,
    part_message,
    result_message,
    valid,
    verdict_message,
)
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.net.wire import MAX_GROUP, Code

logger = logging.getLogger(__name__)
Refusal = tuple[Code, str]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    result_hash: str  # hex: the result the auditor checked
    finding: int  # 0: none; else peer/averaging/reduce.py FindingKind's position + 1
    reason: str
    sig: bytes
    twins: tuple[tuple[int, str, str], ...] = ()  # (member index, digest, its signature): another part it signed us


@dataclass
class ShardState:
    parts: dict[str, bytes] = field(default_factory=dict)  # member -> its part (we reduce or audit this shard)
    invalid: dict[str, str] = field(default_factory=dict)  # member -> why its part was refused on arrival
    result: bytes | None = None  # from the reducer
    result_hash: str = ""
    commits: list[str] = field(default_factory=list)  # the reducer's part digests, per member
    claims: list[str] = field(default_factory=list)  # members the reducer gave weight 0 (probation)
    excluded: list[str] = field(default_factory=list)  # members the reducer left out
    result_sig: bytes = b""
    result_sigs: list[str] = field(default_factory=list)  # per member: its signature of the part the reducer used
    verdict: Verdict | None = None  # from the auditor
    sigs: dict[str, bytes] = field(default_factory=dict)  # member -> its signature of its part (we relay a slow
    # member's; with the cross stage every member's: its word to the designees that it is in our group)
    pledged: dict[str, str] = field(default_factory=dict)  # slow member -> the digest it pledged us (we audit)
    refused: set[str] = field(default_factory=set)  # slow members whose part the reducer says it refused (we audit)
    evidence: list[bytes] | None = None  # our copies of the parts behind our accusation (we audit it)


@dataclass
class Intake:
    """An admitted message whose body the link now reads; ``deposit`` stores it."""

    session: RoundSession
    sender: str
    header: dict[str, Any]
    slot: tuple[Any, ...]
    deadline: float

    def deposit(self, body: bytes) -> Refusal:
        self.session.reading.discard(self.slot)
        return self.session.deposit(self.sender, self.header, body)

    def abort(self) -> None:
        self.session.reading.discard(self.slot)


def _auditors(slots: list[str], reducers: tuple[str, ...]) -> list[str]:
    """The auditor of each shard: the reducer of the next shard (cyclically) that another reducer
    reduces; with equal claims, reducer k + 1. If one reducer took every shard, the next reducer."""
    u = len(slots)
    if len(set(slots)) == 1:
        other = reducers[(reducers.index(slots[0]) + 1) % len(reducers)]
        return [other] * u
    out = [""] * u
    nxt = ""
    for k in range(2 * u - 1, -1, -1):  # backwards, twice round: the nearest different reducer ahead
        j = k % u
        after = slots[(j + 1) % u]
        nxt = after if after != slots[j] else nxt
        out[j] = nxt
    return out


class RoundSession:
    def __init__(self, run: str, round_: int, base: str, order: tuple[str, ...], me: str, numel: int,
                 codec: Codec, audits: bool, deadline: float, piece_values: int | None = None,
                 closed: frozenset[str] = frozenset(), claims: Mapping[str, int] | None = None,
                 units: int | None = None):
        self.run, self.round, self.base, self.order, self.me = run, round_, base, order, me
        self.codec, self.numel, self.deadline = codec, numel, deadline
        self.closed = closed & set(order)  # outbound-only members: nobody dials them, they reduce and audit nothing
        self.claims = {p: (claims or {}).get(p, 0) for p in order}  # uplink claims, kB/s (0: unknown)
        self.group = group_hash(order, round_, base, self.closed, self.claims)
        self.n = len(order)
        self.result_codec = codec.for_results(self.n)  # the reducers' encoding (sparse: room for n parts)
        dialable = [p for p in order if p not in self.closed]
        self.slow = rates.slow(dialable, self.claims)  # too slow to reduce: they only send (rates.py)
        self.reducers = tuple(p for p in dialable if p not in self.slow) or (order if self.n == 1 else ())
        if not self.reducers:
            raise RoundFailed("no member of the group can be dialed: nobody can reduce")
        nr = len(self.reducers)
        self.pieces = pieces_per_member(numel, nr, piece_values) if piece_values else 1
        self.units = units or nr * self.pieces  # shards of the round (``units``: the run's layout, cross.py)
        self.cross_on = units is not None  # the cross-group stage follows (peer/averaging/cross.py)
        self.plan: Plan | None = None  # the round's designees, once derived (cross stage): the top bucket's
        self.local: Plan | None = None  # ... and our bucket's (the same at level 0)
        self.cross: dict[tuple[int, int], tuple[dict[str, Any], bytes]] = {}  # (shard, sub) -> signed mean
        # (shard, sub) -> (forwarder, header): a mean that is our group's own result, forwarded without its
        # bytes before the result itself reached us (it overtakes the megabyte): taken when the result comes
        self.early_cross: dict[tuple[int, int], tuple[str, dict[str, Any]]] = {}
        self.own: torch.Tensor | None = None  # (numel,) fp32: our pseudo-gradient, what a mean is checked against
        self.refused: dict[tuple[int, int], str] = {}  # (shard, sub) -> the signer of a mean we refused (``_far``)
        self.spent: dict[tuple[int, int], set[str]] = {}  # (shard, sub) -> designees that signed (or countersigned)
        # a mean of it we refused: they hold that mean, and would hand it to us again (cross.py ``_late``)
        self.disproven: set[tuple[int, int, str]] = set()  # (shard, sub, mean hash) whose proof did not bear it out
        self.cross_from: dict[tuple[int, int], str] = {}  # (shard, sub) -> who sent us the mean we hold
        self.cross_at = 0.0  # when the last mean we hold came (0: none yet)
        self.passed: set[int] = set()  # shards we reduce whose means we passed on to our members
        self.ended = ""  # why our round failed ("" while it runs, or once it completed)
        self.handed: Counter[str] = Counter()  # members that asked us for a mean we passed on, how often
        self.void = ""  # why our round is void already (a mean our reducer passed on and we refused)
        self._subs: dict[int, tuple[int, int, list[bytes]]] = {}  # shard -> our group's sub-pieces (``sub_pieces``)
        self._values: dict[int, torch.Tensor] = {}  # shard -> our group's approved values of it, decoded
        self.slots = rates.deal(self.reducers, rates.weights(self.reducers, self.claims), self.units)
        self.bounds = shard_bounds(numel, self.units)
        self.index = order.index(me)
        self.audit = audits and nr >= 2
        self.relayed = self.slow if self.audit else frozenset()  # they send one copy; reducers relay the audit's
        self.checkers = _auditors(self.slots, self.reducers)
        self.mine = [k for k in range(self.units) if self.reducer(k) == me]  # shards we reduce
        self.audited = [k for k in range(self.units) if self.auditor(k) == me]  # shards we audit
        self.shards = [ShardState() for _ in range(self.units)]
        self.applied: dict[str, str] = {}  # member -> the digest of what it applied
        self.held: dict[str, str] = {}  # member -> the hash of the statements it holds
        self.statements: dict[str, list[Statement]] = {}  # member whose digest differs -> its statements (fetched)
        self.reading: set[tuple[Any, ...]] = set()
        self.culprits: dict[str, str] = {}  # members caught breaking the protocol in this session -> why
        self.arrived = asyncio.Event()

    # ---- roles and sizes ------------------------------------------------------------------------

    def reducer(self, k: int) -> str:
        return self.slots[k]

    def auditor(self, k: int) -> str | None:
        return self.checkers[k] if self.audit else None

    def reaches_us(self, peer: str) -> bool:
        """Whether ``peer``'s messages can reach us: a closed member cannot dial another closed one."""
        return not (peer in self.closed and self.me in self.closed)

    def shard_nbytes(self, k: int) -> int:
        """Bytes of a member's part of shard ``k``."""
        start, end = self.bounds[k]
        return self.codec.encoded_nbytes(end - start)

    def result_nbytes(self, k: int) -> int:
        """Bytes of the reducer's result of shard ``k``."""
        start, end = self.bounds[k]
        return self.result_codec.encoded_nbytes(end - start)

    def where(self, k: int) -> Where:
        return Where(self.run, self.round, self.group, k)

    def _convict(self, sender: str, code: Code, why: str) -> Refusal:
        self.culprits.setdefault(sender, why)
        self.arrived.set()
        return code, why

    # ---- admission (header only) ------------------------------------------------------------------

    def admit(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | Intake:
        kind = header["type"]
        if sender not in self.order or sender == self.me:
            return Code.NOT_MEMBER, "not a member of this group"
        if kind != "evidence_req" and "shard" in header and header["shard"] >= self.units:
            return self._convict(sender, Code.MALFORMED, f"shard {header['shard']} of {self.units}")
        check = {"part": self._admit_part, "result": self._admit_result, "audit": self._admit_verdict,
                 "applied": self._admit_applied, "pledge": self._admit_pledge, "relay": self._admit_relay}.get(kind)
        if check is None:
            return Code.MALFORMED, f"{kind} is not a session message"
        refusal = check(sender, header, body_len)
        if refusal is not None:
            return refusal
        slot = (kind, header.get("shard", -1), sender, header.get("member", ""))
        if slot in self.reading:
            return Code.BUSY, "the same message is being read"
        self.reading.add(slot)
        return Intake(self, sender, header, slot, self.deadline)

    def admit_cross(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | Intake:
        """A designee's signed mean of one sub-piece: from the designee itself (we reduce that shard
        in our group) or forwarded by our reducer of the shard."""
        k, j = header["shard"], header["sub"]
        if not self.cross_on:
            return Code.MALFORMED, "this run has no cross-group stage"
        if self.plan is None:
            return Code.NOT_READY, "we have not derived the round's designees yet"
        if k >= self.units or j >= self.plan.subs:
            return Code.MALFORMED, f"sub-piece ({k}, {j}) does not exist"
        # (to the reducer: from the signer or its witness, which hands it to a group that came late, or, with
        # buckets, from a designee of our bucket that passes it on)
        carrier = sender in (header["signer"], header["witness"]) or \
            (self.local is not None and sender in self.local.ranked(k, j))
        if sender != self.reducer(k) and not (carrier and self.reducer(k) == self.me):
            return Code.WRONG_ROLE, f"sub-piece ({k}, {j}) comes from its designee to its reducer, then to us"
        if (k, j) in self.cross:
            same = self.cross[(k, j)][0]["result"] == header["result"]
            return (Code.DUPLICATE, "") if same else (Code.DUPLICATE, "we hold another mean of it (first come)")
        if body_len not in (0, self.cross_nbytes(k, j, header["enc"])):
            return Code.WRONG_SIZE, f"sub-piece ({k}, {j}) has {body_len} bytes, not {self.cross_nbytes(k, j, header['enc'])}"
        slot = ("cross_out", k, j)
        if slot in self.reading:
            return Code.BUSY, "the same message is being read"
        self.reading.add(slot)
        return Intake(self, sender, header, slot, self.deadline)

    def cross_nbytes(self, k: int, j: int, enc: int) -> int:
        """Bytes of sub-piece (k, j) encoded with the codec of groups of ``enc`` members."""
        assert self.plan is not None
        start, end = self.bounds[k]
        a, b = self.plan.sub_bounds(start, end)[j]
        return self.codec.for_results(enc).encoded_nbytes(b - a)

    def attester(self, k: int) -> str | None:
        """Who vouches to the designees for our group's sub-pieces of shard ``k``: its auditor (it
        approved or rejected the result), else (no audit) the first other member, else nobody."""
        if self.audit:
            return self.auditor(k)
        return next((p for p in self.order if p != self.reducer(k)), None)

    def deposit_cross(self, sender: str, header: dict[str, Any], body: bytes) -> Refusal:
        assert self.plan is not None
        k = header["shard"]
        if not body and header["result"] != VOID:  # forwarded without its bytes: our group's own result, passed through
            if self.shards[k].result is None and sender == self.reducer(k):  # (one per sub-piece: admit_cross)
                self.early_cross.setdefault((k, header["sub"]), (sender, header))
                return Code.OK, ""
            if self.shards[k].result is None or self.shards[k].result_hash != header["result"]:
                return Code.NOT_READY, f"the result of shard {k} it stands for has not reached us"
            body = self.shards[k].result
        j = header["sub"]
        if (k, j, header["result"]) in self.disproven:  # (sent again: refuted once is enough)
            return Code.MALFORMED, "that mean is not the mean of its groups' values"
        why = checked(header, body, self.plan, self.reducer(k))
        if why and not header["witness"] and sender == header["signer"] and header["signer"] in self.plan.ranked(k, j) \
                and self.plan.needs_witness(k, j):
            # the designee says that its witness did not countersign its mean: our group asks the next pair at once
            self.refused.setdefault((k, j), header["signer"])
            self.arrived.set()
            return Code.MALFORMED, why
        if why:
            # a signer outside our plan may be in our reducer's (boards differ): refused, not held against it
            if sender != header["signer"] and sender in self.order and designated(header, self.plan, self.reducer(k)):
                return self._convict(sender, Code.MALFORMED, f"forwarded a mean that is not a designee's: {why}")
            return Code.MALFORMED, why
        if header["signer"] == self.reducer(k) and header["signer"] not in self.plan.ranked(k, header["sub"]):
            # our reducer's own values, signed by it (``fallen_back``): they must be exactly the sub-piece
            # of the result our auditor checked, not whatever it chose to sign
            if self.shards[k].result is None or (self.audit and self.shards[k].verdict is None):
                return Code.NOT_READY, f"the result of shard {k} and its verdict have not reached us"
            if header["result"] != self._own_sub_hash(k, header["sub"]):
                why = (f"our reducer {header['signer']} signed as our group's own values of sub-piece "
                       f"({k}, {header['sub']}) bytes that are not")
                self.void = self.void or why  # (not a ban: our re-encoding of its values is what we compare)
                self.arrived.set()
                return Code.MALFORMED, why
        elif header["result"] != VOID and self.own is not None:
            far = self._far(k, header, body)
            if far:
                self.refused[(k, header["sub"])] = header["signer"]
                self.spent.setdefault((k, header["sub"]), set()).update({header["signer"], header["witness"]} - {""})
                if sender == self.reducer(k) and sender != self.me:
                    self.void = self.void or far  # our reducer took it: our group applies it, we cannot
                self.arrived.set()
                logger.warning("round %d: %s", self.round, far)
                return Code.MALFORMED, far
        if (header["shard"], header["sub"]) not in self.cross:
            self.cross_from[(header["shard"], header["sub"])] = sender
            self.cross_at = clock.now()
        self.cross.setdefault((header["shard"], header["sub"]), (header, body))
        self.arrived.set()
        return Code.OK, ""

    def hand(self, sender: str, header: dict[str, Any]) -> tuple[Code, str, dict[str, Any], bytes]:
        """The mean of sub-piece (k, j) of a shard we reduce, as we passed it on, for a member that did
        not get it (``AllReduceRunner._fetch``); BUSY while we have not passed it on (we check it, or
        ask the next pair: its designee's mean is not ours to give yet), NOT_READY once our round
        failed without it (then its designees are asked)."""
        k, j = header["shard"], header["sub"]
        if sender not in self.order:
            return Code.NOT_MEMBER, "our group's means are for its members", {}, b""
        if k in self.passed and (k, j) in self.cross:
            if self.handed[sender] >= 2 * self.units * MAX_SUBS:  # (every sub-piece twice: more is a flood)
                return Code.DUPLICATE, "we sent you our means often enough", {}, b""
            self.handed[sender] += 1
            out, body = self.cross[(k, j)]
            return Code.OK, "", dict(out, group=self.group), body
        if self.ended:
            return Code.NOT_READY, f"our round failed without that mean: {self.ended}", {}, b""
        return Code.BUSY, "we have not passed that mean on yet", {}, b""

    def sub_pieces(self, k: int) -> tuple[int, int, list[bytes]]:
        """Our group's contribution to shard ``k``'s means: (weight, enc, one body per sub-piece), from
        the result our auditor checked (weight 0 and no values if it rejected it). One sub-piece: the
        reducer's bytes as they are; several: its values re-encoded per sub-piece. What our reducer
        sends the designees, and all that it may sign as our own values (``fallen_back``)."""
        if k in self._subs:
            return self._subs[k]
        plan, shard = self.plan, self.shards[k]
        assert plan is not None and shard.result is not None
        approved = not self.audit or (shard.verdict is not None and shard.verdict.ok)
        weight = self.n - len(set(shard.excluded) | set(shard.claims)) if approved else 0
        if weight <= 0:
            out: tuple[int, int, list[bytes]] = (0, MAX_GROUP, [b""] * plan.subs)
        elif plan.subs == 1:
            out = (weight, self.n, [shard.result])
        else:
            start, end = self.bounds[k]
            values = self.result_codec.decode(shard.result, end - start)  # (end - start,) fp32
            codec = cross_codec(self.codec)
            out = (weight, MAX_GROUP, [codec.encode(values[a - start:b - start].contiguous())
                                       for a, b in plan.sub_bounds(start, end)])
        self._subs[k] = out
        return out

    def _own_sub_hash(self, k: int, j: int) -> str:
        try:
            body = self.sub_pieces(k)[2][j]
        except CodecError:
            return ""
        return hashlib.sha256(body).hexdigest() if body else VOID

    def _far(self, k: int, header: dict[str, Any], body: bytes) -> str:
        """Why a designee's mean of sub-piece (k, j) is not one we apply ("" if it is): it lies
        further from our own pseudo-gradient than an average of honest groups can (cross.py ``off``).
        A designee's mean is not audited; this bounds what a lying one can do to us."""
        assert self.plan is not None and self.own is not None
        j = header["sub"]
        start, end = self.bounds[k]
        a, b = self.plan.sub_bounds(start, end)[j]
        try:
            mean = self.codec.for_results(header["enc"]).decode(body, b - a)
        except CodecError as e:
            return f"the mean of sub-piece ({k}, {j}) signed by {header['signer']} is malformed: {e}"
        shard = self.shards[k]
        group = None
        if shard.result is not None and (not self.audit or (shard.verdict is not None and shard.verdict.ok)):
            if k not in self._values:
                try:
                    self._values[k] = self.result_codec.decode(shard.result, end - start)
                except CodecError:
                    self._values[k] = torch.zeros(0)
            if self._values[k].numel() == end - start:
                group = self._values[k][a - start:b - start]
        ratio = off(mean, self.own[a:b], group)
        if ratio <= MEAN_BOUND:
            return ""
        return (f"the mean of sub-piece ({k}, {j}) signed by {header['signer']} lies {ratio:.3g} x our values' "
                f"norm from our own pseudo-gradient (at most {MEAN_BOUND} from an average of honest groups): refused")

    def _admit_part(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        k = header["shard"]
        if self.reducer(k) != self.me and self.auditor(k) != self.me:
            return Code.WRONG_ROLE, f"we neither reduce nor audit shard {k}"
        if sender in self.relayed and self.reducer(k) != self.me:
            return Code.WRONG_ROLE, f"the audit copy of a slow member's part of shard {k} comes from its reducer"
        shard = self.shards[k]
        if sender in shard.parts:
            same = digest(shard.parts[sender]) == header["digest"]
            return (Code.DUPLICATE, "") if same else self._convict(sender, Code.EQUIVOCATION,
                                                                    f"sent two different parts of shard {k}")
        if sender in shard.invalid:
            return Code.EQUIVOCATION, f"its part of shard {k} was already refused: {shard.invalid[sender]}"
        if body_len != self.shard_nbytes(k):
            why = f"its part of shard {k} has {body_len} bytes, not {self.shard_nbytes(k)}"
            shard.invalid[sender] = why  # marked, so that we do not wait for it until the deadline
            self.arrived.set()
            return Code.WRONG_SIZE, why
        if (sender in self.relayed or self.cross_on) and not valid(sender, bytes.fromhex(header["sig"]),
                                                                   part_message(self.where(k), header["digest"])):
            # (cross stage: the signature is the member's word that it is in our group, for the designees)
            return self._convict(sender, Code.MALFORMED, f"its part of shard {k} is not signed by it")
        return None

    def _admit_pledge(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        k = header["shard"]
        if sender not in self.relayed or self.auditor(k) != self.me:
            return Code.WRONG_ROLE, f"a pledge is a slow member's word to the auditor of shard {k}"
        if body_len:
            return Code.WRONG_SIZE, "a pledge has no body"
        pledged = self.shards[k].pledged.get(sender)
        if pledged is not None:
            return (Code.DUPLICATE, "") if pledged == header["digest"] else self._convict(
                sender, Code.EQUIVOCATION, f"pledged two different parts of shard {k}")
        return None

    def _admit_relay(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        k, member = header["shard"], header["member"]
        if sender != self.reducer(k) or self.auditor(k) != self.me:
            return self._convict(sender, Code.WRONG_ROLE, f"relayed a part of shard {k}, which it does not reduce")
        if member not in self.relayed:
            return self._convict(sender, Code.MALFORMED, f"relayed the part of {member}, who sends us its own")
        shard = self.shards[k]
        if member in shard.parts or member in shard.refused:
            held = digest(shard.parts[member]) if member in shard.parts else ""
            return (Code.DUPLICATE, "") if held == header["digest"] else self._convict(
                sender, Code.EQUIVOCATION, f"relayed two different parts of {member} for shard {k}")
        if not header["digest"]:  # the reducer refused that part: its word, checked against the pledge
            return None if not body_len and not header["sig"] else self._convict(
                sender, Code.MALFORMED, "a refusal carries no part")
        if body_len != self.shard_nbytes(k):
            return self._convict(sender, Code.WRONG_SIZE, f"relayed a part of shard {k} of the wrong size")
        if not valid(member, bytes.fromhex(header["sig"]), part_message(self.where(k), header["digest"])):
            return self._convict(sender, Code.MALFORMED, f"relayed a part of shard {k} that {member} did not sign")
        return None

    def _admit_result(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        k = header["shard"]
        if sender != self.reducer(k):
            return self._convict(sender, Code.WRONG_ROLE, f"sent a result of shard {k}, which it does not reduce")
        if self.reducer(k) == self.me:
            return Code.WRONG_ROLE, "we reduce that shard ourselves"
        shard = self.shards[k]
        if shard.result is not None:
            if shard.result_hash == header["result"]:
                return Code.DUPLICATE, ""
            return self._convict(sender, Code.EQUIVOCATION, f"signed two different results of shard {k}")
        order = set(self.order)
        claims, excluded = header["probation"], header["excluded"]
        if (len(header["parts"]) != self.n or len(set(claims)) != len(claims) or not set(claims) <= order
                or not set(excluded) <= order):
            return self._convict(sender, Code.MALFORMED, f"its result of shard {k} has malformed commitments")
        commit = commitment(header["parts"], claims, excluded)
        message = result_message(self.where(k), bytes.fromhex(header["result"]), commit)
        if not valid(sender, bytes.fromhex(header["sig"]), message):
            return self._convict(sender, Code.MALFORMED, f"its result of shard {k} is not signed by it")
        if body_len != self.result_nbytes(k):
            return self._convict(sender, Code.WRONG_SIZE, f"its result of shard {k} has the wrong size")
        return None

    def _admit_verdict(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        k = header["shard"]
        if not self.audit or sender != self.auditor(k):
            return self._convict(sender, Code.WRONG_ROLE, f"sent a verdict on shard {k}, which it does not audit")
        if self.auditor(k) == self.me:
            return Code.WRONG_ROLE, "we audit that shard ourselves"
        if body_len:
            return Code.WRONG_SIZE, "a verdict has no body"
        verdict = self.shards[k].verdict
        if verdict is not None:
            if (verdict.ok, verdict.result_hash) == (header["ok"], header["result"]):
                return Code.DUPLICATE, ""
            return self._convict(sender, Code.EQUIVOCATION, f"signed two different verdicts on shard {k}")
        message = verdict_message(self.where(k), header["ok"], bytes.fromhex(header["result"]))
        if not valid(sender, bytes.fromhex(header["sig"]), message):
            return self._convict(sender, Code.MALFORMED, f"its verdict on shard {k} is not signed by it")
        return None

    def _admit_applied(self, sender: str, header: dict[str, Any], body_len: int) -> Refusal | None:
        if sender in self.applied:
            if self.applied[sender] == header["digest"]:
                return Code.DUPLICATE, ""
            return self._convict(sender, Code.EQUIVOCATION, "reported two different applied digests")
        if body_len:
            return Code.WRONG_SIZE, "an applied report has no body (statements are asked for)"
        return None

    # ---- deposit (with the body) --------------------------------------------------------------

    def deposit(self, sender: str, header: dict[str, Any], body: bytes) -> Refusal:
        kind = header["type"]
        k = header.get("shard", -1)
        if kind == "cross_out":
            return self.deposit_cross(sender, header, body)
        if kind == "part":
            shard = self.shards[k]
            if digest(body) != header["digest"]:
                shard.invalid[sender] = f"its part of shard {k} does not match the digest it sent"
                self.arrived.set()
                return Code.MALFORMED, shard.invalid[sender]
            shard.parts[sender] = body
            if sender in self.relayed or self.cross_on:
                shard.sigs[sender] = bytes.fromhex(header["sig"])
        elif kind == "pledge":
            self.shards[k].pledged[sender] = header["digest"]
            self._check_pledge(k, sender)
        elif kind == "relay":
            shard, member = self.shards[k], header["member"]
            if not header["digest"]:
                shard.refused.add(member)
                shard.invalid[member] = f"its reducer {sender} refused its part of shard {k}"
            elif digest(body) != header["digest"]:  # (the signature is the member's: the bytes were altered on the way)
                shard.invalid[member] = f"the copy of its part of shard {k} relayed by {sender} was altered"
                return self._convict(sender, Code.MALFORMED, f"relayed an altered part of {member} for shard {k}")
            else:
                shard.parts[member] = body
                self._check_pledge(k, member)
        elif kind == "result":
            if hashlib.sha256(body).hexdigest() != header["result"]:
                return self._convict(sender, Code.MALFORMED, f"its result of shard {k} does not match its hash")
            shard = self.shards[k]
            shard.result, shard.result_hash, shard.result_sig = body, header["result"], bytes.fromhex(header["sig"])
            shard.commits, shard.claims, shard.excluded = header["parts"], header["probation"], header["excluded"]
            shard.result_sigs = [sig.hex() for sig in header["sigs"]]
            for (held_k, j) in [key for key in self.early_cross if key[0] == k]:
                forwarder, mean = self.early_cross.pop((held_k, j))
                if shard.result_hash == mean["result"]:  # (else it stands for another result: never taken)
                    self.deposit_cross(forwarder, mean, b"")
        elif kind == "audit":
            self.shards[k].verdict = Verdict(header["ok"], header["result"], header["finding"], header["reason"],
                                             bytes.fromhex(header["sig"]), tuple((i, d, g) for i, d, g in header["twins"]))
        elif kind == "applied":
            self.applied[sender], self.held[sender] = header["digest"], header["held"]
        self.arrived.set()
        return Code.OK, ""

    def _check_pledge(self, k: int, member: str) -> None:
        """A slow member that pledged us one part of shard ``k`` and signed another for its reducer
        equivocated: caught (the signed part is the one the reducer used, so the audit still checks it)."""
        shard = self.shards[k]
        pledged, held = shard.pledged.get(member), shard.parts.get(member)
        if pledged is not None and held is not None and digest(held) != pledged:
            self._convict(member, Code.EQUIVOCATION, f"pledged one part of shard {k} to its auditor and signed "
                                                     "another for its reducer")

    def twins(self, k: int) -> list[tuple[int, str, str]]:
        """As auditor of shard ``k``: (index, digest, signature) of each member whose signed copy we hold
        is another part than the one its reducer used, signed too: the member signed two parts of one
        shard (review N7: it made the shard unverifiable, unblamed, every round)."""
        shard, out = self.shards[k], []
        for i, p in enumerate(self.order):
            used = shard.commits[i] if i < len(shard.commits) else ""
            held = shard.parts.get(p)
            if not used or held is None or p not in shard.sigs or digest(held) == used:
                continue
            if self._signed_both(k, i, used, digest(held), shard.sigs[p].hex()):
                out.append((i, digest(held), shard.sigs[p].hex()))
        return out

    def _signed_both(self, k: int, i: int, used: str, other: str, other_sig: str) -> bool:
        """Whether member ``i`` signed both the part its reducer used (``used``, its signature in our
        copy of the result) and another one (``other``) for shard ``k``."""
        return used != other and self._signed(k, i, used) and self._valid_part_sig(k, i, other, other_sig)

    def _signed(self, k: int, i: int, used: str) -> bool:
        """Whether our copy of shard ``k``'s result carries member ``i``'s signature of ``used``."""
        sigs = self.shards[k].result_sigs
        return i < len(sigs) and bool(sigs[i]) and self._valid_part_sig(k, i, used, sigs[i])

    def _valid_part_sig(self, k: int, i: int, part_digest: str, sig: str) -> bool:
        return valid(self.order[i], bytes.fromhex(sig), part_message(self.where(k), part_digest))

    def proven_twins(self) -> dict[str, str]:
        """{member: why} for every member an auditor's verdict proves signed two parts of one shard,
        checked on our own copy of the reducer's result (its commitments and the members' signatures).
        A proof whose second signature does not check is the auditor's: it names a member it cannot
        show to have lied. (If our copy of the member's first signature does not check, the reducer
        sent us another list than the auditor: nothing here proves who; the round's agreement may.)"""
        out: dict[str, str] = {}
        for k, shard in enumerate(self.shards):
            verdict, auditor = shard.verdict, self.auditor(k)
            if verdict is None or not verdict.twins or shard.result is None or auditor is None:
                continue
            for i, other, sig in verdict.twins:
                used = shard.commits[i] if i < min(self.n, len(shard.commits)) else ""
                if not used or used == other or not self._signed(k, i, used):
                    continue
                if self._valid_part_sig(k, i, other, sig):
                    out.setdefault(self.order[i], f"signed two different parts of shard {k}: one for its reducer, "
                                                  f"another for its auditor {auditor}")
                else:
                    out.setdefault(auditor, f"its verdict on shard {k} names {self.order[i]} with a part it did not sign")
        return out

    def contested(self, k: int) -> list[str]:
        """Slow members of shard ``k`` (we audit) that pledged a part their reducer says it refused:
        one of the two lies, and nothing tells which."""
        shard = self.shards[k]
        return [p for p in self.order if p in shard.refused and p in shard.pledged]

    def evidence(self, sender: str, header: dict[str, Any]) -> tuple[Code, bytes]:
        """Our copy of one part behind our accusation of shard ``header['shard']``."""
        if sender not in self.order:
            return Code.NOT_MEMBER, b""
        k, index = header["shard"], header["index"]
        parts = self.shards[k].evidence if k < self.units else None
        if parts is None or index >= len(parts) or not parts[index]:
            return Code.NO_EVIDENCE, b""
        return Code.OK, parts[index]

    # ---- waiting ---------------------------------------------------------------------------------

    def has_parts(self, k: int) -> bool:
        shard = self.shards[k]
        return all(p in shard.parts or p in shard.invalid for p in self.order)

    async def wait_for(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Waits until ``ready()`` (re-checked whenever a message arrives); RoundFailed past ``deadline``."""
        while not ready():
            if self.void:
                raise RoundFailed(self.void, dict(self.culprits))
            remaining = deadline - clock.now()
            if remaining <= clock.EPSILON:
                raise RoundFailed(f"deadline passed waiting for the {what}", dict(self.culprits))
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                pass

    def bound(self) -> int:
        """The most bytes of peer input a session can hold: the parts of the shards we reduce and
        audit from every member, every shard's result, and every member's statements."""
        subs = min(MAX_SUBS, max(1, -(-self.numel // self.units) // MIN_SUB_VALUES))  # sub-pieces per shard, at most
        means = max(cross_codec(self.codec).encoded_nbytes(self.numel), self.result_codec.encoded_nbytes(self.numel)) + \
            self.units * subs * 16 if self.cross_on else 0  # (+ a chunk's scale and offset per sub-piece)
        return sum(2 * self.shard_nbytes(k) + self.result_nbytes(k) for k in range(self.units)) + \
            self.n * self.units * STATEMENT_LEN + means

    def held_bytes(self) -> int:
        """Bytes of peer input this session holds (parts, results, evidence): bounded by its group."""
        total = 0
        for shard in self.shards:
            total += sum(map(len, shard.parts.values())) + len(shard.result or b"")
            total += sum(map(len, shard.evidence or []))
        total += sum(len(body) for _, body in self.cross.values())
        return total + sum(len(s) * STATEMENT_LEN for s in self.statements.values())
