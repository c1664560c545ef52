"""The simulator's attack library: what the two reviews showed, carried out by k identities on M prefixes.

An attack is injected from outside the protocol, as a test's fault is: a ``Behaviour`` that the
attackers' real peers run (they answer wrongly where the protocol asks them what to send), an
``actor`` (a coroutine on the simulator's loop that uses the attackers' identities and links as an
outsider would: raw requests over the seam, signed records in the DHT), or both. The scenario names
its attacks (``Scenario.attacks``) and its attackers (``Scenario.dishonest``, on
``Scenario.attacker_prefixes`` /24s); ``happened`` reads the run's result for evidence that the
honest side saw the attack (a refused record, a void round, a ban, a foreign group member): an
attack test asserts it, so no test passes on an attack that never took place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hivetrain.dht import clock
from hivetrain.peer.averaging.behaviour import Behaviour
from hivetrain.peer.averaging.ready import Ready, sign
from hivetrain.peer.faults import attack_part
from hivetrain.peer.net.wire import ZERO

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


def link_of(swarm: Swarm, peer: SimPeer) -> Any:
    """The attacker's link: its running peer's, or one of its own (an identity that runs no peer)."""
    link = swarm.net.links.get(peer.id)
    if link is None:
        link = swarm.net.link(peer.id, peer.addr)
    return link


def current_round(swarm: Swarm) -> int:
    """The highest round an honest peer has recorded (0 before any)."""
    return max((int(rec.get("round", 0)) for i, rec in swarm.records if rec.get("event") == "round"), default=-1) + 1


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
        bad = attacker_ids(result)
        seen = [(i, rec["round"]) for i, rec in honest_rounds(result) if not rec.get("void")
                and bad & set(rec.get("group", ()))]
        return f"{len(seen)} honest peer-rounds completed in a group with a biased member" if seen else None


class Nan(Attack):
    name = "nan"
    about = "a member sends parts whose scale is NaN (review-2026-12 prior 8c/8d)"

    def behaviour(self, swarm: Swarm, peer: SimPeer) -> Behaviour | None:
        return PartAttack("nan")

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        for peer in result.honest():
            for incarnation in peer.incarnations:
                hits = {p for p in bad if p in incarnation.averager.ctx.bans}
                if hits:
                    return f"peer {peer.index} banned the NaN sender"
        return None


# ---- attacks by an outside actor -----------------------------------------------------------------------


class ReadyFlood(Attack):
    name = "ready_flood"
    about = ("N5: self-signed ready records for every round at the honest base, from identities that "
             "never answer (the candidate set is first-come-first-served)")
    runs_peer = False
    per_identity = 1  # ready records per attacker identity per round (one subkey each: its peer id)

    async def actor(self, swarm: Swarm, attackers: list[SimPeer]) -> None:
        spec_hash = swarm.spec.spec_hash().hex()
        published: set[int] = set()
        while True:
            r = max(0, current_round(swarm))
            bases = {rec.get("state_hash") or ZERO for i, rec in swarm.records
                     if rec.get("event") in ("round", "start") and int(rec.get("round", 0)) == r - 1} or {ZERO}
            for round_ in (r, r + 1):
                if round_ in published:
                    continue
                published.add(round_)
                for peer in attackers:
                    for base in sorted(bases)[:1]:
                        ready = Ready(peer.id, round_, base, spec_hash, True, clock.wall(), False)
                        await swarm.dht.store(peer.id, sign(peer.identity, swarm.run_key, ready, 60.0))
            await asyncio.sleep(1.0)

    def happened(self, result: Result) -> str | None:
        bad = attacker_ids(result)
        stored = sum(1 for node in result.dht.nodes.values() for key, held in node.storage.items()
                     if "/ready/" in key for sub in held if any(b in str(sub) for b in bad))
        return f"{stored} attacker ready records held by DHT nodes" if stored else None


LIBRARY: dict[str, Attack] = {a.name: a for a in (Bias(), Nan(), ReadyFlood())}
ATTACK_NAMES: tuple[str, ...] = tuple(LIBRARY)
_ = Callable  # (re-exported type for attack modules)
