"""The simulator's attack library: what the two reviews showed, carried out by k identities on M prefixes.

An attack is injected from outside the protocol, as a test's fault is: a ``Behaviour`` that the
attackers' real peers run (they answer wrongly where the protocol asks them what to send), an
``actor`` (a coroutine on the simulator's loop that uses the attackers' identities and links as an
outsider would: raw requests over the seam, signed records in the DHT), or both. The scenario names
its attacks (``Scenario.attacks``) and its attackers (``Scenario.dishonest``, on
``Scenario.attacker_prefixes`` /24s); ``happened`` reads the run's result for evidence that the
honest side saw the attack (a refused record, a void round, a ban, a foreign group member): an
attack test asserts it, so no test passes on an attack that never took place.

An actor learns what an outsider can learn: the round, base and peer ids of the honest peers from
their signed ready records and heartbeats in the DHT (it reads them as a DHT client), never from
the honest peers' objects. The review findings (../shared/research/review-2026-12-02-security.md
N1-N10, review-2026-12.md) each have one attack below, named in its ``about``.

unverifiable_parts needs one hook the protocol did not have: ``Behaviour.part_for`` (the part as sent
to one recipient, reducer or auditor), asked by peer/averaging/allreduce.py where parts are sent;
the honest one returns the part it is given, and the honest path sends exactly what it sent before.

What the simulator cannot express, and so is carried out only in part:

- relayed_votes (N6): the simulated addresses can be ``/p2p-circuit`` addresses (the relay's IP),
  so relayed attackers escaped the per-/24 cap of matchmaking (until 2026-12-08: they now count as
  their relays' /24) and counted one joiner vote per relay IP; the attackers here train honestly, so
  the evidence is a group over the cap, or held to it. Capturing a joiner with those votes also
  needs a forged state served, which this attack does not combine.
- dht_key_fill (N8): one DHT, nearest-node replication, no routing tables: the key is filled at
  every replica a writer reaches, which is the review's "not run across real DHT replicas" case.
- serving_lockout (N2): the attackers' streams are silent before their header; a requester that
  sends a header and then never reads its reply is a stall of the writer's ``drain``, which the
  simulated pipes do not model (they deliver whatever is written), so that half is tested on the
  server alone (tests/unit/test_link.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hivetrain.dht import clock
from hivetrain.dht.records import heartbeat_key
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.context import PROTOCOL_VERSION as AVG_VERSION
from hivetrain.peer.averaging.ready import Ready, sign, verified
from hivetrain.peer.faults import attack_part, attack_result
from hivetrain.peer.net import dialback
from hivetrain.peer.net.link import Server, request
from hivetrain.peer.net.wire import ZERO, Code, encode_header, reason
from hivetrain.peer.sim.dht import Costs
from hivetrain.peer.state.heartbeats import heartbeat_envelope, heartbeat_level
from hivetrain.peer.state.serve import MAX_PER_REQUESTER
from hivetrain.peer.state.serve import protocol_name as state_protocol

if TYPE_CHECKING:
    import torch

    from hivetrain.kernels.int8 import Codec
    from hivetrain.peer.sim.swarm import Result, SimPeer, Swarm


class Attack:
    """One attack of the library (stateless: a run's state lives in the swarm and its peers)."""

    name = ""
    about = ""  # one line: what it does and which review finding it is
    runs_peer = True  # the attacker identities run the real peer (with ``behaviour``); False: only the actor

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        """The Behaviour this attacker's peer runs (None: the honest one)."""
        return None

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        """Runs alongside the swarm from its start; cancelled when the run ends."""

    def happened(self, result: Result) -> str | None:
        """Evidence that the honest side saw the attack (None: it did not happen)."""
        raise NotImplementedError


# ---- helpers ---------------------------------------------------------------------------------------


def honest_rounds(result: Result) -> list[tuple[int, dict[str, Any]]]:
    honest = {p.index for p in result.honest()}
    return [(i, rec) for i, rec in result.records if i in honest and rec.get("event") == "round"]


def attacker_ids(result: Result) -> set[str]:
    return {p.id for p in result.peers if not p.honest}


def incarnations(result: Result) -> list[tuple[int, Any]]:
    """(index, Peer) of every start of every honest peer."""
    return [(p.index, inc) for p in result.honest() for inc in p.incarnations]


def link_of(swarm: Swarm, peer: SimPeer) -> Any:
    """The attacker's link: its running peer's, or one of its own (an identity that runs no peer)."""
    link = swarm.net.links.get(peer.id)
    if link is None:
        link = swarm.net.link(peer.id, peer.addr)
    return link


def current_round(swarm: Swarm) -> int:
    """The highest round an honest peer has recorded (0 before any)."""
    return max((int(rec.get("round", 0)) for i, rec in swarm.records if rec.get("event") == "round"), default=-1) + 1


def avg_protocol(swarm: Swarm) -> str:
    return f"hivetrain/avg/{AVG_VERSION}/{swarm.spec.spec_hash().hex()[:32]}"


def run_hash(swarm: Swarm) -> str:
    return swarm.spec.spec_hash().hex()


def client(swarm: Swarm, peer: SimPeer | str) -> str:
    """``peer`` as a DHT client (an identity that runs no node still reads and writes records)."""
    pid = peer if isinstance(peer, str) else peer.id
    swarm.dht.costs.setdefault(pid, Costs())
    return pid


async def board(swarm: Swarm, spy: SimPeer, round_: int) -> list[Ready]:
    """The round's valid ready records, as any DHT client reads them."""
    from hivetrain.dht.records import ready_key

    envelopes = await swarm.dht.get(client(swarm, spy), ready_key(swarm.run_key, round_))
    return [r for r in map(verified, envelopes) if r is not None and r.round == round_]


async def heartbeats(swarm: Swarm, spy: SimPeer) -> list[dict[str, Any]]:
    from hivetrain.dht.records import decode_bound

    out, level = [], heartbeat_level(swarm.spec)
    for bucket in range(1 << level):
        for envelope in await swarm.dht.get(client(swarm, spy), heartbeat_key(swarm.run_key, level, bucket)):
            try:
                out.append(decode_bound("hb", envelope))
            except Exception:
                continue
    return out


def view_header(swarm: Swarm, round_: int, base: str, members: list[str], decided: bool = False,
                closed: bool = False) -> dict[str, Any]:
    return {"type": "view", "run": run_hash(swarm), "round": round_, "base": base, "members": sorted(members),
            "excluded": [], "closed": closed, "decided": decided, "up": 0, "derived": True}


async def quietly(work: Awaitable[Any]) -> Any:
    """An attacker's request: whatever the honest side answers or fails with, the attack goes on."""
    try:
        return await work
    except Exception:
        return None


async def on_ready(swarm: Swarm, attackers: list[SimPeer], act: Callable[[int, str, str, int], Awaitable[Any]],
                   poll: float = 0.1) -> None:
    """Follows the public board: calls ``act(round, base, peer, n)`` once for each honest peer's
    "done" ready record (``n`` counts the records seen, for spreading the work over the attackers)."""
    bad = {p.id for p in attackers}
    seen: set[tuple[int, str, str]] = set()
    r = 0
    async with asyncio.TaskGroup() as tasks:
        while True:
            top = r
            for round_ in (r, r + 1):
                for rec in await board(swarm, attackers[0], round_):
                    key = (round_, rec.base, rec.peer_id)
                    if rec.done and rec.peer_id not in bad and key not in seen:
                        seen.add(key)
                        top = max(top, round_)
                        tasks.create_task(quietly(act(round_, rec.base, rec.peer_id, len(seen))))
            r = top
            await asyncio.sleep(poll)


class _Stalled:
    """A ticket that never completes: the asker waits for its own timeout."""

    deadline = 0.0

    async def complete(self, body: bytes) -> Any:
        await asyncio.sleep(3600.0)
        raise TimeoutError

    def abort(self) -> None:
        pass


class Stall:
    """A ``Service`` that takes every stream and never answers (a silent candidate)."""

    max_body = 0

    def admit(self, sender: str, header: dict[str, Any], body_len: int, remote: str = "") -> Any:
        return _Stalled()

    def refusal(self, header: dict[str, Any], code: Code, why: str) -> Any:
        return {"type": "ack", "run": header.get("run", ZERO), "round": header.get("round", 0),
                "base": header.get("base", ZERO), "code": int(code), "reason": reason(why)}, b""

    def is_member(self, peer: str) -> bool:
        return True


async def stall_on(swarm: Swarm, attackers: list[SimPeer]) -> dict[str, Any]:
    """The attackers' links, each serving averaging with a silent ``Stall`` (an identity that runs no peer)."""
    links = {p.id: link_of(swarm, p) for p in attackers}
    for p in attackers:
        if not p.runs:
            await links[p.id].serve(avg_protocol(swarm), Server(Stall(), max_others=10**6, max_per_peer=10**6))
    return links


def matchmakings(result: Result) -> list[tuple[int, int, Any]]:
    """(index, round, Matchmaking) that honest averagers still hold (their last two rounds)."""
    return [(i, r, mm) for i, inc in incarnations(result) for r, mm in inc.averager.matchmaking.items()]


def banned(result: Result) -> list[tuple[int, str, str]]:
    """(honest index, attacker, why) for every ban of an attacker by an honest peer."""
    bad = attacker_ids(result)
    return [(i, p, inc.averager.ctx.bans.why(p) or "") for i, inc in incarnations(result) for p in sorted(bad)
            if p in inc.averager.ctx.bans]


def with_attackers(result: Result) -> list[tuple[int, dict[str, Any]]]:
    """Honest completed peer-rounds whose group held an attacker."""
    bad = attacker_ids(result)
    return [(i, rec) for i, rec in honest_rounds(result) if not rec.get("void") and bad & set(rec.get("group", ()))]


def ban_evidence(result: Result, what: str) -> str | None:
    bans = banned(result)
    if bans:
        i, _, why = bans[0]
        return f"{len(bans)} bans of {what} by honest peers (peer {i}: {why})"
    return None


def part_evidence(result: Result, what: str) -> str | None:
    """A bad part seen: honest peer-rounds that left its sender out (void or not), bans of it, or
    honest peer-rounds completed with it in the group (a pair is a plain mean: nothing left out)."""
    bad = attacker_ids(result)
    left = [(i, rec["round"]) for i, rec in honest_rounds(result) if bad & set(rec.get("excluded") or {})]
    bans = banned(result)
    kept = with_attackers(result)
    if left or bans or kept:
        return (f"{what}: left out in {len(left)} honest peer-rounds, banned {len(bans)} times, in the group of "
                f"{len(kept)} completed honest peer-rounds")
    return None


# ---- attacks in a Behaviour --------------------------------------------------------------------------


class PartAttack(Behaviour):
    """A group member that sends ``action`` (peer/faults.py ``attack_part``) instead of its parts."""

    def __init__(self, action: str):
        self.action = action
        self.sent = 0

    def parts(self, round_: int, parts: list[bytes], delta: torch.Tensor, bounds: list[tuple[int, int]],
              codec: Codec) -> list[bytes]:
        self.sent += 1
        return [attack_part(self.action, part, delta[a:b], codec) for part, (a, b) in zip(parts, bounds, strict=True)]


class Bias(Attack):
    name = "bias"
    about = "a member sends its pseudo-gradient times -1000 (a biased part; robust aggregation must bound it)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return PartAttack("flip")

    def happened(self, result: Result) -> str | None:
        seen = with_attackers(result)
        return f"{len(seen)} honest peer-rounds completed in a group with a biased member" if seen else None


class Nan(Attack):
    name = "nan"
    about = "a member sends parts whose scale is NaN (review-2026-12 prior 8c/8d)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return PartAttack("nan")

    def happened(self, result: Result) -> str | None:
        return part_evidence(result, "the NaN sender")


class Huge(Attack):
    name = "huge"
    about = "a member sends its pseudo-gradient times 1e6 (FaultPlan 'huge'; outlier removal must drop it)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return PartAttack("huge")

    def happened(self, result: Result) -> str | None:
        return part_evidence(result, "the huge part's sender")


class Unverifiable(Behaviour):
    """N7: a member whose auditor gets another well-formed, correctly digested part than its reducer."""

    def __init__(self) -> None:
        self.other: dict[tuple[int, int], bytes] = {}

    def parts(self, round_: int, parts: list[bytes], delta: torch.Tensor, bounds: list[tuple[int, int]],
              codec: Codec) -> list[bytes]:
        self.other = {(round_, k): bytes(codec.encode(delta[a:b] * 0.5)) for k, (a, b) in enumerate(bounds)}
        return parts

    def part_for(self, round_: int, shard: int, recipient: str, auditor: bool, part: bytes) -> bytes:
        return self.other.get((round_, shard), part) if auditor else part


class UnverifiableParts(Attack):
    name = "unverifiable_parts"
    about = ("N7: a member sends its reducer and its auditor different well-formed parts, so every shard it "
             "is in is 'unverifiable' (void; with the cross stage its group's values are left out of it)")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return Unverifiable()

    def happened(self, result: Result) -> str | None:
        hit = [(i, rec) for i, rec in with_attackers(result) if rec.get("void_shards")]
        void = [(i, rec) for i, rec in honest_rounds(result) if rec.get("void")
                and "unverifiable" in str(rec.get("why", "")) + str(rec.get("excluded", ""))]
        if hit or void:
            shards = sum(len(rec["void_shards"]) for _, rec in hit)
            proven = [b for b in banned(result) if "signed two different parts" in b[2]]
            return (f"{len(hit)} honest peer-rounds with the attacker had {shards} void shard ranges in rounds "
                    f"{sorted({rec['round'] for _, rec in hit if rec['void_shards']})}; {len(void)} void rounds named "
                    f"an unverifiable shard; {len(proven)} bans for signing two parts")
        return None


class AlteringRelay(Behaviour):
    """A reducer that alters every other slow member's part it relays to the shard's auditor and
    says it refused the rest (protocol 8's relayed audit copies)."""

    def relay_for(self, round_: int, shard: int, member: str, part: bytes) -> bytes | None:
        return bytes([part[0] ^ 1]) + part[1:] if shard % 2 == 0 else None


class TamperedRelay(Attack):
    name = "tampered_relay"
    about = ("a reducer alters the slow members' parts it relays to their auditors, or says it refused them "
             "(relay_for): the auditor must convict it or find the shard unverifiable, never audit altered bytes")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return AlteringRelay()

    def happened(self, result: Result) -> str | None:
        return split_evidence(result, "tampering reducer")


class EquivocatingAuditor(Behaviour):
    """N9: an auditor whose verdict is 'ok' to half its group and 'rejected' to the other half."""

    def verdict_for(self, round_: int, shard: int, recipient: str, ok: bool) -> bool:
        return hashlib.sha256(recipient.encode()).digest()[0] % 2 == 0


class EquivocatingReducer(Behaviour):
    """A reducer whose result is right for half its group and shifted for the other half."""

    def result_for(self, round_: int, shard: int, recipient: str, result: bytes, numel: int, codec: Codec) -> bytes:
        if hashlib.sha256(recipient.encode()).digest()[0] % 2:
            return attack_result(result, numel, codec)
        return result


def split_evidence(result: Result, what: str) -> str | None:
    """Bans, void rounds or void shards of honest peers grouped with the attacker, or honest members
    of one group that ended a round on different states."""
    bad = attacker_ids(result)
    states: dict[tuple[int, tuple[str, ...]], set[str]] = {}
    for _, rec in with_attackers(result):
        states.setdefault((rec["round"], tuple(sorted(rec["group"]))), set()).add(rec["state_hash"])
    split = sum(len(s) > 1 for s in states.values())
    shards = sum(bool(rec.get("void_shards")) for _, rec in with_attackers(result))
    void = [(i, rec) for i, rec in honest_rounds(result) if rec.get("void") and bad & set(rec.get("excluded") or {})]
    bans = banned(result)
    if split or shards or void or bans:
        return (f"{what}: {split} groups split into different states, {shards} honest peer-rounds with void "
                f"shards, {len(void)} void rounds excluding it, {len(bans)} bans")
    return None


class EquivocatingAuditorAttack(Attack):
    name = "equivocating_auditor"
    about = "N9: an auditor signs 'ok' to half its group and 'rejected' to the other half (verdict_for)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return EquivocatingAuditor()

    def happened(self, result: Result) -> str | None:
        return split_evidence(result, "equivocating auditor")


class EquivocatingReducerAttack(Attack):
    name = "equivocating_reducer"
    about = "prior 8g: a reducer sends the right result to half its group and a shifted one to the rest (result_for)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return EquivocatingReducer()

    def happened(self, result: Result) -> str | None:
        return split_evidence(result, "equivocating reducer")


class Liar(Behaviour):
    def dialback_answer(self, asker: str, connected: bool) -> bool:
        return False


class DialbackLies(Attack):
    name = "dialback_lies"
    about = ("N3: attacker peers answer every dial-back check 'could not reach you', and connect to every "
             "honest peer first, so they are among the 3 asked")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return Liar()

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        await asyncio.sleep(0)  # the honest peers' links are up: connect to each (first in its list)
        for x in attackers:
            link = swarm.net.links.get(x.id)
            if link is None:
                continue
            for peer in swarm.peers:
                if peer.honest:
                    await quietly(request(link, peer.id, dialback.PROTOCOL, {"type": "dialback", "ports": [1]},
                                          b"", 1.0))

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        lied = [(i, inc.reachability.verdict) for i, inc in incarnations(result)
                if any(p in bad and not ok for p, ok in inc.reachability.verdict.answers)]
        if not lied:
            return None
        closed = sum(v.mode == dialback.OUTBOUND_ONLY for _, v in lied)
        return f"{len(lied)} honest peers heard 'not reachable' from attackers; {closed} now think they are outbound-only"


# ---- attacks by an outside actor -----------------------------------------------------------------------


def candidates_evidence(result: Result, what: str) -> str | None:
    """Attackers that honest matchmaking took as candidates (or saw on the board)."""
    bad = attacker_ids(result)
    held = [(i, r, len(bad & (mm.view.candidates | mm.view.left_out)), len(bad & mm.seen), len(bad & mm.view.left_out))
            for i, r, mm in matchmakings(result)]
    held = [h for h in held if h[2] or h[3]]
    if not held:
        return None
    most = max(held, key=lambda h: (h[2], h[3]))
    return (f"{what}: {len(held)} honest matchmakings held attackers (peer {most[0]} round {most[1]}: "
            f"{most[2]} attacker candidates, {most[4]} of them left out by the derived partition, "
            f"{most[3]} attackers on its board)")


async def ready_ahead(swarm: Swarm, attackers: list[SimPeer], ttl: float, poll: float = 1.0) -> None:
    """Publishes each attacker's ready record for every round at the honest base as soon as the
    heartbeats show that base (seconds after the previous round; honest peers first train): the
    round's earliest records. A ``ttl`` past the peers' own keeps them over a running attacker's own."""
    spec_hash = run_hash(swarm)
    published: set[tuple[int, str]] = set()
    while True:
        r, bases = -1, {ZERO}
        for hb in await heartbeats(swarm, attackers[0]):  # the honest peers' latest states: the next base
            if hb["peer_id"] not in {p.id for p in attackers}:
                if hb["round"] > r:  # (a heartbeat's round is the round its state is the base of)
                    r, bases = hb["round"], {hb["state_hash"]}
                elif hb["round"] == r:
                    bases.add(hb["state_hash"])
        for round_ in (r, r + 1) if r >= 0 else ():
            for base in sorted(bases) if round_ == r else [ZERO]:
                if (round_, base) in published:
                    continue
                published.add((round_, base))
                for peer in attackers:
                    ready = Ready(peer.id, round_, base, spec_hash, round_ == r, clock.wall(), False)
                    await swarm.dht.store(client(swarm, peer), sign(peer.identity, swarm.run_key, ready, ttl))
                    if ready.done:
                        peer.log.append(f"ready ahead: round {round_} eta {ready.eta!r}")
        await asyncio.sleep(poll)


def ready_ahead_etas(result: Result) -> dict[int, float]:
    """round -> the earliest ``eta`` an attacker's ``ready_ahead`` published for it."""
    out: dict[int, float] = {}
    for p in result.peers:
        for line in p.log if not p.honest else ():
            if line.startswith("ready ahead: round "):
                _, _, _, r, _, eta = line.split()
                out[int(r)] = min(out.get(int(r), math.inf), float(eta))
    return out


class ReadyFlood(Attack):
    name = "ready_flood"
    about = ("N5b: self-signed ready records for every round at the honest base, from identities that "
             "never answer (the candidate set is first-come-first-served)")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        await stall_on(swarm, attackers)
        await ready_ahead(swarm, attackers, 60.0)

    def happened(self, result: Result) -> str | None:
        return candidates_evidence(result, "ready flood")


class CandidateFlood(Attack):
    name = "candidate_flood"
    about = ("N5a: every attacker identity sends one view request per honest peer and round, then never "
             "answers (each costs a view timeout; 256 fill the candidate set)")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        links = await stall_on(swarm, attackers)

        async def act(round_: int, base: str, peer: str, n: int) -> None:
            await asyncio.gather(*(quietly(request(links[x.id], peer, avg_protocol(swarm),
                                                   view_header(swarm, round_, base, [x.id]), b"", 3.0))
                                   for x in attackers))

        await on_ready(swarm, attackers, act)

    def happened(self, result: Result) -> str | None:
        return candidates_evidence(result, "candidate flood")


class DecidedPair(Attack):
    name = "decided_pair"
    about = ("N1: a view request [P, X], then one marked decided with the same members, to each honest peer P, "
             "from an identity that never published a ready record (adopted: P drops its group and averages "
             "with X alone)")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        links = await stall_on(swarm, attackers)

        async def act(round_: int, base: str, peer: str, n: int) -> None:
            x = attackers[n % len(attackers)]
            for decided in (False, True):  # asked first: a decision is adopted only from a peer that asked
                await request(links[x.id], peer, avg_protocol(swarm),
                              view_header(swarm, round_, base, [peer, x.id], decided=decided), b"", 3.0)

        await on_ready(swarm, attackers, act, poll=0.05)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        pairs = [(i, r) for i, r, mm in matchmakings(result)
                 if mm.view.decided is not None and bad & set(mm.view.decided)]
        pairs += [(i, rec["round"]) for i, rec in with_attackers(result)]
        refused = [(i, r) for i, r, mm in matchmakings(result)
                   if any("cannot accept" in mm.view.excluded.get(b, "") or b in mm.view.reports for b in bad)]
        if not pairs and not refused:
            return None
        return (f"{len(set(pairs))} honest peer-rounds decided a group with an attacker; "
                f"{len(set(refused))} heard its decision and refused it")


class EarlyPart(Attack):
    name = "early_part"
    about = ("N4: a view request (to become a candidate), then one part header for a junk group during "
             "matchmaking: the window closes at once, and the attacker never answers")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        links = await stall_on(swarm, attackers)
        junk = hashlib.sha256(b"junk group").hexdigest()

        async def act(round_: int, base: str, peer: str, n: int) -> None:
            x = attackers[n % len(attackers)]
            link = links[x.id]
            await request(link, peer, avg_protocol(swarm), view_header(swarm, round_, base, [x.id]), b"", 1.0)
            part = {"type": "part", "run": run_hash(swarm), "round": round_, "base": base, "group": junk, "shard": 0,
                    "digest": "0" * 32, "sig": ""}
            await request(link, peer, avg_protocol(swarm), part, b"\0" * 16, 1.0)

        await on_ready(swarm, attackers, act, poll=0.05)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        urgent = [(i, r) for i, r, mm in matchmakings(result) if bad & mm.urgent]
        early = [(i, r) for i, r, mm in matchmakings(result) if bad & mm.early]
        if not urgent and not early:
            return None
        alone = sum(1 for _, rec in honest_rounds(result) if not rec.get("void") and rec.get("group_size") == 1)
        return f"{len(early)} honest matchmakings got an attacker's junk part before deciding, {len(urgent)} " \
               f"closed their window on it; {alone} honest peer-rounds trained alone"


class ServingLockout(Attack):
    name = "serving_lockout"
    about = ("N2: each attacker holds silent streams on every honest peer's state protocol (4 per identity, "
             "one more refused); before 2026-12-05, 8 identities filled the 32 slots and joiners got BUSY")
    runs_peer = False
    streams = MAX_PER_REQUESTER + 1

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        protocol = state_protocol(run_hash(swarm))
        links = {p.id: link_of(swarm, p) for p in attackers}

        async def hold(x: SimPeer, peer: str) -> None:
            while True:
                opened = clock.now()
                try:
                    reader, writer = await links[x.id].open(peer, protocol, 5.0)
                    await reader.read()  # silent: the server times our header out (or refuses us BUSY)
                    writer.close()
                except Exception:
                    pass
                await asyncio.sleep(0.01 if clock.now() - opened > 1.0 else 1.0)  # held it: take it again at once

        async with asyncio.TaskGroup() as tasks:
            held: set[str] = set()
            while True:
                for hb in await heartbeats(swarm, attackers[0]):
                    peer = hb["peer_id"]
                    if peer not in held and peer not in links:
                        held.add(peer)
                        for x in attackers:
                            for _ in range(self.streams):
                                tasks.create_task(hold(x, peer))
                await asyncio.sleep(1.0)

    def happened(self, result: Result) -> str | None:
        servers = [inc.service.server for _, inc in incarnations(result)]
        hit = [s for s in servers if s.refused_busy or s.evicted]
        if not hit:
            return None
        return f"{len(hit)} honest state servers refused {sum(s.refused_busy for s in hit)} streams BUSY and gave " \
               f"{sum(s.evicted for s in hit)} silent streams' places to newcomers"


class OversizedBodies(Attack):
    name = "oversized_bodies"
    about = ("prior 6: requests whose prefix claims a 1 TB body (over every protocol's cap) to every honest "
             "peer's averaging and state protocols; the body is never sent")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        links = {p.id: link_of(swarm, p) for p in attackers}
        huge = 1 << 40

        async def send(x: SimPeer, peer: str, protocol: str, header: dict[str, Any]) -> None:
            reader, writer = await links[x.id].open(peer, protocol, 5.0)
            writer.write(encode_header(header, huge))
            await asyncio.wait_for(reader.read(), 5.0)
            writer.close()

        async def act(round_: int, base: str, peer: str, n: int) -> None:
            x = attackers[n % len(attackers)]
            part = {"type": "part", "run": run_hash(swarm), "round": round_, "base": base,
                    "group": hashlib.sha256(b"g").hexdigest(), "shard": 0, "digest": "0" * 32, "sig": ""}
            state = {"type": "state_req", "run": run_hash(swarm), "round": round_, "base": base, "index": 0}
            await quietly(send(x, peer, avg_protocol(swarm), part))
            await quietly(send(x, peer, state_protocol(run_hash(swarm)), state))

        await on_ready(swarm, attackers, act)

    def happened(self, result: Result) -> str | None:
        refused = [(i, inc.averager.server.traffic.by_kind["?"] + inc.service.server.traffic.by_kind["?"])
                   for i, inc in incarnations(result)]
        refused = [(i, n) for i, n in refused if n]
        if not refused:
            return None
        return f"{len(refused)} honest peers refused oversized requests on their prefix ({sum(n for _, n in refused) // 64} replies)"


class ForgedHeartbeats(Attack):
    name = "forged_heartbeats"
    about = ("prior 1: self-signed heartbeats attesting a state past the honest peers' best, whose parent is "
             "that honest state (nobody serves it): even attackers claim 1000 rounds ahead (beyond what time "
             "allows), odd ones 2 rounds (within it: weightless for established peers, a joiner contacts them)")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        bad = {p.id for p in attackers}
        while True:
            honest = [hb for hb in await heartbeats(swarm, attackers[0]) if hb["peer_id"] not in bad]
            if honest:
                best = max(honest, key=lambda hb: (hb["round"], hb["state_hash"]))
                forged = hashlib.sha256(f"forged/{best['state_hash']}".encode()).hexdigest()
                for j, x in enumerate(attackers):
                    ahead = 2 if j % 2 else 1000
                    envelope = heartbeat_envelope(x.identity, swarm.run_key, 120.0, level=heartbeat_level(swarm.spec),
                                                  round=best["round"] + ahead,
                                                  state_hash=forged, parent=best["state_hash"], throughput=1e6,
                                                  train_loss=None, eval_loss=None, reach="direct")
                    await swarm.dht.store(client(swarm, x), envelope)
            await asyncio.sleep(2.0)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        refused = [i for i, inc in incarnations(result) if bad & set(inc.keeper._named)]
        followed = [i for i, inc in incarnations(result) if bad & set(inc.keeper._seen)]
        if refused or followed:
            return (f"{len(refused)} honest peers refused the forged heartbeats, {len(followed)} accepted a claim "
                    "from an attacker")
        return None


class DHTKeyFill(Attack):
    name = "dht_key_fill"
    about = ("N8: the attackers' free identities (256 in all, each its own DHT client) fill ready/<r> for the "
             "coming rounds ahead of the honest peers, who then lose the subkey-cap tie")
    runs_peer = False
    subkeys = 256
    ahead = 2  # rounds filled ahead of the honest peers' latest

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        from hivetrain.peer.sim.swarm import seeded_identity

        per = -(-self.subkeys // len(attackers))
        sybils = [seeded_identity(swarm.scenario.seed, "sybil", x.index, j) for x in attackers for j in range(per)]
        spec_hash, bad = run_hash(swarm), {p.id for p in attackers}
        filled: set[int] = set()
        while True:
            rounds = [hb["round"] for hb in await heartbeats(swarm, attackers[0]) if hb["peer_id"] not in bad]
            top = max(rounds, default=-1) + 1
            for round_ in range(top, top + self.ahead + 1):
                if round_ in filled:
                    continue
                filled.add(round_)
                for sybil in sybils:  # done at a base nobody holds: they crowd the key, they are not candidates
                    ready = Ready(sybil.peer_id, round_, ZERO, spec_hash, True, clock.wall(), False)
                    await swarm.dht.store(client(swarm, sybil.peer_id), sign(sybil, swarm.run_key, ready, 600.0))
            await asyncio.sleep(1.0)

    def happened(self, result: Result) -> str | None:
        refused: dict[str, int] = {}
        for node in result.dht.nodes.values():
            for why in ("subkey_cap", "evicted_others"):
                refused[why] = refused.get(why, 0) + node.refused[why]
        if not sum(refused.values()):
            return None
        return f"DHT nodes refused {refused['subkey_cap']} records at the subkey cap and evicted " \
               f"{refused['evicted_others']} records of others"


class RelayedVotes(Attack):
    name = "relayed_votes"
    about = ("N6 (in part): attacker peers reachable only as /p2p-circuit addresses, each through a relay IP "
             "of their own /24, to escape the per-/24 cap of groups and a joiner's one vote per prefix; "
             "they train honestly, no forged state is served")

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        for j, x in enumerate(attackers):
            ip = x.addr.split("/")[2].rsplit(".", 1)[0] + f".{100 + j}"
            relay = hashlib.sha256(f"relay/{j}".encode()).hexdigest()[:16]
            x.addr = f"/ip4/{ip}/tcp/4001/p2p/relay{relay}/p2p-circuit"  # what restarts use too
            if x.id in swarm.net.links:
                swarm.net.addrs[x.id] = x.addr

    def happened(self, result: Result) -> str | None:
        from hivetrain.peer.net.prefixes import first_prefix

        cap = result.scenario.run_spec().max_per_prefix
        relayed = {p.id for p in result.peers if not p.honest and "/p2p-circuit" in result.net.addrs.get(p.id, "")}
        over = []
        for i, rec in with_attackers(result):
            members = relayed & set(rec["group"])
            by_prefix: dict[str, int] = {}
            for p in members:  # the /24 of the relays (the attackers' own) as a direct address would show it
                prefix = first_prefix([result.net.addrs[p].split("/p2p/")[0]]) or ""
                by_prefix[prefix] = by_prefix.get(prefix, 0) + 1
            if cap and max(by_prefix.values(), default=0) > cap:
                over.append((i, rec["round"]))
        grouped = [(i, rec["round"]) for i, rec in with_attackers(result) if relayed & set(rec["group"])]
        if over:
            return f"{len(over)} honest peer-rounds grouped more than {cap} relayed attackers of one /24"
        if grouped:
            return f"{len(grouped)} honest peer-rounds grouped relayed attackers (prefix cap not reached)"
        return None


class InflatedGroup(Attack):
    name = "inflated_group"
    about = ("a group's weight was its reducer's claim: two identities on the board send every designee a "
             "made-up group naming every ready peer, weighing them all, with values 100x the honest scale, "
             "one attesting the other's bytes (cross stage)")
    runs_peer = False

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        import torch

        from hivetrain.peer.averaging import cross
        from hivetrain.peer.averaging.api import shard_bounds
        from hivetrain.peer.averaging.statements import Where, sign_part

        links = await stall_on(swarm, attackers)
        spec, spec_hash, numel = swarm.spec, run_hash(swarm), swarm.scenario.numel
        units_ = cross.units(numel, spec.target_group_size, spec.piece_values)
        window, settle = cross.windows(spec.matchmaking_timeout)
        done: set[tuple[int, str]] = set()
        pair = attackers[:2] if len(attackers) >= 2 else attackers * 2

        async def attack(round_: int, base: str) -> None:
            for peer in attackers:  # on the board: ready at the honest base (and silent: never in a group)
                ready = Ready(peer.id, round_, base, spec_hash, True, clock.wall(), False)
                await swarm.dht.store(client(swarm, peer), sign(peer.identity, swarm.run_key, ready, 60.0))
            await asyncio.sleep(window + settle + 0.5)  # the designees have read the board
            records = await board(swarm, attackers[0], round_)
            plan = cross.derive(records, round_, base, spec_hash, units_, numel, window)
            names = sorted({r.peer_id for r in records if r.done and r.base == base})[:63]
            members = sorted({pair[0].id, pair[1].id, *names})[:64]
            group = hashlib.sha256(f"inflated/{round_}/{base}".encode()).hexdigest()
            codec = cross.cross_codec(spec.codec())
            sends = []
            for k, (start, end) in enumerate(shard_bounds(numel, units_)):
                words = {p.id: ("0" * 32, sign_part(p.identity, Where(spec_hash, round_, group, k), "0" * 32))
                         for p in pair}
                blob = cross.vouch(members, words)
                for j, (a, b) in enumerate(plan.sub_bounds(start, end)):
                    body = codec.encode(torch.full((b - a,), 100.0))
                    header = {"type": "cross", "run": spec_hash, "round": round_, "base": base, "group": group,
                              "shard": k, "sub": j, "members": members, "weight": len(members),
                              "result": hashlib.sha256(body).hexdigest(), "enc": 64, "attest": False, "ok": True,
                              "tier": 0, "bucket": 0, "groups": 1, "vouch": blob, "witness": ""}
                    header["sig"] = signed_sub(pair[0], header)
                    ranked = plan.ranked(k, j)
                    if len(ranked) >= 2:  # (the designee and its witness, as an honest reducer sends it)
                        header["witness"] = ranked[1]
                    for designee in ranked[:2]:
                        sends.append(quietly(request(links[pair[0].id], designee, avg_protocol(swarm), header,
                                                     body, 5.0)))
                        word = dict(header, attest=True, vouch=b"", witness="")
                        word["sig"] = signed_sub(pair[1], word)
                        sends.append(quietly(request(links[pair[1].id], designee, avg_protocol(swarm), word, b"",
                                                     5.0)))
            await asyncio.gather(*sends)

        async def act(round_: int, base: str, peer: str, n: int) -> None:
            if (round_, base) not in done:
                done.add((round_, base))
                await attack(round_, base)

        await on_ready(swarm, attackers, act)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        held = [(i, r, e) for i, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                for u in desk.work.values() for e in u.entries.values() if e.holder in bad]
        if not held:
            return None
        most = max(e.weight for _, _, e in held)
        return (f"{len(held)} made-up groups taken by honest designees (claiming weight {most}; "
                f"{max(len(e.vouched) for _, _, e in held)} members vouched at most)")


def signed_sub(peer: SimPeer, header: dict[str, Any]) -> str:
    """An attacker's signature of a ``cross`` request it makes up, as an honest sender signs its own."""
    from hivetrain.peer.averaging import cross

    h = header
    return peer.identity.sign(cross.sub_message(h["run"], h["round"], h["base"], h["group"], h["shard"], h["sub"],
                                                h["members"], h["weight"], h["result"], h["enc"], h["vouch"],
                                                h["attest"], h["ok"])).hex()


def colluders(swarm: Swarm, peer: SimPeer) -> frozenset[str]:
    """The other attackers' ids: a designee attacker signs their means unchecked as their witness."""
    return frozenset(p.id for p in swarm.peers if not p.honest and p.id != peer.id)


class ShiftedMean(Behaviour):
    """A designee that sends every sub-piece's mean times ``factor`` (a mean it signs as its own)."""

    def __init__(self, factor: float = -1000.0, colluders: frozenset[str] | None = None):
        self.factor = factor
        self.colluders = colluders  # the other attackers: as their witness we sign their means unchecked

    def mean_for(self, round_: int, shard: int, sub: int, mean: bytes, numel: int, codec: Codec) -> bytes:
        return bytes(codec.encode(codec.decode(mean, numel) * self.factor))

    def countersigns(self, round_: int, shard: int, sub: int, designee: str) -> bool:
        return self.colluders is not None and designee in self.colluders  # (as a witness: another attacker's mean)


class EarlyReady(Attack):
    name = "early_ready"
    about = ("running attacker peers publish their ready records as soon as a round's base is known (they "
             "need not train first): the round's earliest records, from which the designees, the cutoff and "
             "whom the designees wait for are derived; otherwise honest")

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        await ready_ahead(swarm, attackers, 300.0, poll=0.25)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        first = [(i, r) for i, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                 if desk.plan is not None and desk.plan.designees and set(desk.plan.designees) <= bad]
        etas = ready_ahead_etas(result)
        ahead = [(i, r) for i, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                 if desk.plan is not None and r in etas and etas[r] < desk.plan.t0 and bad & desk.plan.ready]
        if not first and not ahead:
            return None
        return (f"{len(ahead)} honest plans read an attacker's ready record before their anchor (rounds "
                f"{sorted({r for _, r in ahead})}); {len(first)} honest peer-rounds whose designees were all "
                f"attackers (rounds {sorted({r for _, r in first})})")


class LyingDesignee(Attack):
    name = "lying_designee"
    about = ("the attackers publish their ready records as soon as a round's base is known (the round's "
             "earliest: its designees), then sign and send back every sub-piece's mean times -1000")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return ShiftedMean(colluders=colluders(swarm, peer))

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        await ready_ahead(swarm, attackers, 300.0, poll=0.25)  # the round's earliest records: its designees

    def happened(self, result: Result) -> str | None:
        honest = {p.id for p in result.honest()}
        told = [(r, u) for p in result.peers if not p.honest for inc in p.incarnations
                for r, desk in inc.averager.desks.items() for u in desk.work.values()
                if u.out is not None and any(e.holder in honest for e in u.entries.values())]
        early = EarlyReady().happened(result)
        if not told and not early:
            return None
        bad = attacker_ids(result)
        refused = [(i, rec["round"]) for i, rec in honest_rounds(result)
                   if any(p in bad and "too far" in str(why) for p, why in dict(rec.get("excluded") or {}).items())]
        return (f"{len(told)} shifted means sent to honest reducers in rounds {sorted({r for r, _ in told})}; "
                f"{early or 'no honest peer-round whose designees were all attackers'}; "
                f"{len(refused)} honest peer-rounds refused an attacker's mean")


class FlippingDesignee(LyingDesignee):
    name = "flipping_designee"
    about = ("as lying_designee, but the mean it signs is the true one times -1: the update reversed, within "
             "the bound a reducer and a member check a mean against (cross.py MEAN_BOUND)")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return ShiftedMean(-1.0, colluders(swarm, peer))


class DrawnDesignee(Attack):
    name = "drawn_designee"
    about = ("an identity that behaves honestly in every stage (its ready record at the time it trained, so it "
             "is one designee among those near the anchor) and signs every mean it draws times -1: the update "
             "reversed, within the bound a mean is checked against (cross.py MEAN_BOUND)")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return ShiftedMean(-1.0, colluders(swarm, peer))

    def happened(self, result: Result) -> str | None:
        honest, bad = {p.id for p in result.honest()}, attacker_ids(result)
        told = [r for p in result.peers if not p.honest for inc in p.incarnations
                for r, desk in inc.averager.desks.items() for u in desk.work.values()
                if u.out is not None and u.out[1] and any(e.holder in honest for e in u.entries.values())]
        refused = [r for _, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                   for designee, _ in desk.refused.values() if designee in bad]
        if not told and not refused:
            return None
        return (f"{len(refused)} means of sub-pieces drawn by an attacker refused by honest witnesses in rounds "
                f"{sorted(set(refused))}; {len(told)} attacker means sent to honest reducers in rounds "
                f"{sorted(set(told))}")


class Partisan(Behaviour):
    """A designee that averages one group alone: a group of one it makes up of itself, whose values are
    a group's sub-piece it received times ``factor``, sent to its witness as any reducer sends its own
    (a group of one needs no other member's word, and the witness checks the mean, not the choice)."""

    def __init__(self, swarm: Swarm, peer: SimPeer, factor: float = -1.0, edge: float = 0.0):
        self.swarm, self.peer, self.factor, self.edge = swarm, peer, factor, edge
        self.sent: set[asyncio.Task[Any]] = set()

    def averaged(self, round_: int, base: str, shard: int, sub: int, groups: list[Any], numel: int,
                 codec: Codec) -> list[Any]:
        import dataclasses
        from collections import Counter

        from hivetrain.peer.averaging import cross
        from hivetrain.peer.averaging.aggregation import weighted_robust_mean
        from hivetrain.peer.averaging.statements import Where, sign_part

        real = [g for g in groups if g.body and g.counts() and g.holder != self.peer.id]
        named = Counter(g.witness for g in groups if g.witness)
        if not real or not named:
            return groups
        witness, source = named.most_common(1)[0][0], real[0]
        results = codec.for_results(source.enc)
        values = results.decode(source.body, numel) * self.factor
        if self.edge:  # just inside the witness's bound: the groups' robust mean moved edge spreads toward 0 and past
            rows = [codec.for_results(g.enc).decode(g.body, numel) for g in real]
            weights = [max(1, len(g.vouched)) for g in real]
            center = weighted_robust_mean(rows, weights)
            shift = self.edge * cross.groups_spread(rows, weights)
            values = center * (1.0 - shift / max(float(center.norm()), 1e-12))
        body = bytes(results.encode(values))
        me, run = self.peer.id, run_hash(self.swarm)
        group = hashlib.sha256(f"partisan/{me}/{round_}/{base}".encode()).hexdigest()
        blob = cross.vouch([me], {me: ("0" * 32, sign_part(self.peer.identity, Where(run, round_, group, shard), "0" * 32))})
        result = hashlib.sha256(body).hexdigest()
        header = {"type": "cross", "run": run, "round": round_, "base": base, "group": group, "shard": shard,
                  "sub": sub, "members": [me], "weight": 1, "result": result, "enc": source.enc, "attest": False,
                  "ok": True, "tier": 0, "bucket": 0, "groups": 1, "vouch": blob, "witness": witness}
        header["sig"] = signed_sub(self.peer, header)
        task = asyncio.get_running_loop().create_task(quietly(request(
            link_of(self.swarm, self.peer), witness, avg_protocol(self.swarm), header, body, 5.0)))
        self.sent.add(task)
        task.add_done_callback(self.sent.discard)
        return [dataclasses.replace(source, holder=me, group=group, members=frozenset({me}), weight=1, body=body,
                                    result=result, attested=None, attester="", vouched=frozenset({me}), witness="",
                                    banned=False, sig=bytes.fromhex(header["sig"]), vouch=blob, order=(me,),
                                    word=None)]


class PartisanDesignee(Attack):
    name = "partisan_designee"
    about = ("an identity that behaves honestly in every stage (so one designee among those near the anchor) "
             "and, as a designee, averages one group alone: a group of one it makes up of itself, whose values "
             "are an honest group's sub-piece reversed (within MEAN_BOUND), and which it sends to its witness "
             "as a reducer would: the mean is right for the groups it names, and it names none of the honest ones")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return Partisan(swarm, peer)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        held = [(i, r) for i, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                for u in desk.work.values() for e in u.entries.values() if e.holder in bad and e.members <= bad]
        refused = [r for _, inc in incarnations(result) for r, desk in inc.averager.desks.items()
                   for designee, _ in desk.refused.values() if designee in bad]
        if not held and not refused:
            return None
        return (f"{len(held)} made-up groups of attackers held by honest witnesses in rounds "
                f"{sorted({r for _, r in held})}; {len(refused)} attacker means refused by honest witnesses")


class EdgingDesignee(PartisanDesignee):
    name = "edging_designee"
    about = ("as partisan_designee, but the made-up group's values are the groups' robust mean moved 0.95 x "
             "the witness's allowance (cross.py CHOICE_SPREAD x the groups' spread) toward zero and past it: "
             "the furthest mean an honest witness may countersign, in the direction that undoes the update")

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        from hivetrain.peer.averaging.cross import CHOICE_SPREAD

        return Partisan(swarm, peer, edge=0.95 * CHOICE_SPREAD)


LIBRARY: dict[str, Attack] = {a.name: a for a in (
    Bias(), Nan(), Huge(), UnverifiableParts(), EquivocatingAuditorAttack(), EquivocatingReducerAttack(),
    DialbackLies(), ReadyFlood(), CandidateFlood(), DecidedPair(), EarlyPart(), ServingLockout(),
    OversizedBodies(), ForgedHeartbeats(), DHTKeyFill(), RelayedVotes(), TamperedRelay(), InflatedGroup(), EarlyReady(), LyingDesignee(),
    FlippingDesignee(), DrawnDesignee(), PartisanDesignee(), EdgingDesignee())}
ATTACK_NAMES: tuple[str, ...] = tuple(LIBRARY)
# the attacks the search's small and large families draw from (peer/sim/search.py): fixed, so that a
# documented seed keeps its schedule when the library grows; later attacks are drawn by later families
FIRST_ATTACKS: tuple[str, ...] = ATTACK_NAMES[:16]
SLOW_ATTACKS: tuple[str, ...] = ATTACK_NAMES[:17]  # (the slow family's)
ANY_ATTACKS: tuple[str, ...] = ATTACK_NAMES[:18]  # (the ANY family's)
LATEST_ATTACKS: tuple[str, ...] = ATTACK_NAMES[:21]  # (the LATEST family's)
NOW_ATTACKS: tuple[str, ...] = ATTACK_NAMES[:22]  # (the NOW family's; the whole library from NEXT_SEEDS on)
