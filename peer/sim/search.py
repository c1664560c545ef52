"""The attack search: random schedules of attackers, attacks and honest churn, with invariants checked.

A schedule is drawn from its seed alone (``schedule``): the run's size and group target, f < n/3
attacker identities on M of their own /24s (1 <= M <= f), one or two attacks of the library
(peer/sim/attacks.py), readiness jitter, and perhaps an honest peer that crashes and restarts. So a
violation is reproduced by its seed (``replay``), on any machine.

The invariants, checked on the run's result (``check``):

- I1: no honest peer ends on a state that descends from a round in which an honest peer applied a
  mean further from the honest mean than I1_BOUND x the largest honest deviation: at the round's
  base, the honest peers' pseudo-gradients (swarm.py's ``Probe``: the same sample of coordinates of
  each) have a mean m and lie at most D from it; every mean an honest peer applied (outside its void
  shards) must lie within I1_BOUND x D of m (plus the int8 codec's rounding). Any average of honest
  parts lies within D, so what lies further is what attackers did. Where one honest peer alone
  averaged at a base, D is 0 and every mean with anybody else would break I1 (search seed 6,201,101:
  an attacker that sent its own honestly computed parts to a lone honest peer, 1.23e12 x): there the
  attackers' own pseudo-gradients at that base (what their learners computed, before any attack)
  join the honest one to make m and D, so what an attacker did to its parts still counts. Nor may
  an honest peer end on a state built on one that only attackers' rounds computed: the simulator's
  attackers compute their states honestly, but a real one's is any bytes it likes (seed 6,200,418
  was seen by the zero spread above; this is what it broke). (Before the cross-group stage's robust
  mean, I1 asked instead that every group have an honest majority: with one model per round a
  group's mean is one of the round's inputs, and small derived groups without one are drawn by
  chance. I7 still counts them.)
- I2: distinct honest states per round (measured; step 13 makes it 1);
- I3: no honest peer is banned by an honest peer;
- I4: the fraction of honest peer-rounds that completed (measured);
- I5: every container a peer holds stays within ``MAX_CONTAINER`` entries (memory per peer bounded);
- I6: honest peer-rounds that completed at their all-reduce deadline (measured). With the search's
  small vectors a round takes seconds; one that completes only at its deadline waited for something
  that never came and then went on (a member's applied report withheld, or a wait the protocol
  should not have: a vouch for a sub-piece whose mean had long arrived held rounds open until the
  deadline, and the others voided without that peer);
- I7: the rounds (their states) that an honest peer applied from a group without an honest
  majority, or with a shard that an attacker reduced and no honest member audited (measured: what
  I1 was before).

I2, I4, I6 and I7 are numbers, not pass/fail: they are reported per schedule.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hivetrain.peer.sim.attacks import (
    ANY_ATTACKS,
    FIRST_ATTACKS,
    LATEST_ATTACKS,
    LIBRARY,
    NOW_ATTACKS,
    SLOW_ATTACKS,
)
from hivetrain.peer.sim.measure import ancestors, final_states, lineage
from hivetrain.peer.sim.swarm import Event, Probe, Result, Scenario, simulate

DEADLINE_SHARE = 0.9  # of allreduce_timeout: a completed round this long is counted in I6
I1_BOUND = 1.25  # x the largest honest deviation: aggregation.py's measured bound for one group
I1_ROUNDING = 0.02  # x the largest honest norm: what the int8 codec's rounding may add (<= 1/254 of a chunk's max per value)
MAX_CONTAINER = 8192  # entries; a schedule has at most a few dozen peers: anything past this grew without bound
WALK_DEPTH = 4  # attribute levels below a peer that I5 inspects


@dataclass(frozen=True)
class Violation:
    invariant: str
    seed: int
    attack: str
    summary: str

    def as_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "seed": self.seed, "attack": self.attack, "summary": self.summary}


LARGE_SEEDS = 1_000_000  # seeds from here draw the large family (``schedule``)
RELAY_SEEDS = 2_000_000  # ... and from here the slow family: a third of the peers on slow links
ANY_SEEDS = 3_000_000  # ... and from here the small family's runs with any of the library's first 18 attacks
LATEST_SEEDS = 4_000_000  # ... and from here with any of its first 21 attacks
NOW_SEEDS = 5_000_000  # ... and from here with any of its first 22 attacks
NEXT_SEEDS = 6_000_000  # ... and from here with any attack of the library as it is now


def schedule(seed: int) -> Scenario:
    """The random schedule of ``seed`` (deterministic). Seeds from ``LARGE_SEEDS`` on draw a large
    run instead: 24 to 40 peers at target 2, with ``expected_peers`` in the spec, so that ready
    records and heartbeats spread over buckets and many groups meet in the cross-group stage (the
    small family never exercises either); seeds below keep the schedules documented before it.
    From ``RELAY_SEEDS`` on, the slow family (``_slow``); from ``ANY_SEEDS`` on, the small family's
    runs drawing from the library's first 18 attacks (``ANY_ATTACKS``), from ``LATEST_SEEDS`` on from
    its first 21 (``LATEST_ATTACKS``), from ``NOW_SEEDS`` on from its first 22 (``NOW_ATTACKS``), and
    from ``NEXT_SEEDS`` on from the whole library: every family's list but the last is frozen, so
    that a documented seed keeps its schedule when the library grows; a new attack is drawn from
    NEXT_SEEDS on."""
    if seed >= NEXT_SEEDS:
        return _small(seed, random.Random(f"search-next/{seed}"), tuple(LIBRARY))
    if seed >= NOW_SEEDS:
        return _small(seed, random.Random(f"search-now/{seed}"), NOW_ATTACKS)
    if seed >= LATEST_SEEDS:
        return _small(seed, random.Random(f"search-latest/{seed}"), LATEST_ATTACKS)
    if seed >= ANY_SEEDS:
        return _small(seed, random.Random(f"search-any/{seed}"), ANY_ATTACKS)
    if seed >= RELAY_SEEDS:
        return _slow(seed)
    if seed >= LARGE_SEEDS:
        return _large(seed)
    return _small(seed, random.Random(f"search/{seed}"), FIRST_ATTACKS)


def _small(seed: int, rng: random.Random, library: tuple[str, ...]) -> Scenario:
    n = rng.randint(6, 14)
    f = rng.randint(1, (n - 1) // 3)  # f < n/3
    prefixes = rng.randint(1, f)
    attacks = tuple(sorted(rng.sample(sorted(library), rng.choice((1, 1, 2)))))
    dishonest = tuple(sorted(rng.sample(range(n), f)))
    honest = [i for i in range(n) if i not in dishonest]
    events: tuple[Event, ...] = ()
    if rng.random() < 0.4:  # honest churn: one peer crashes during the run and restarts from its checkpoint
        events = (Event(at=round(rng.uniform(3.0, 25.0), 3), kind="crash", peers=(rng.choice(honest),),
                        until=round(rng.uniform(2.0, 15.0), 3)),)
    return Scenario(peers=n, rounds=4, target=rng.choice((4, 8)), jitter_s=rng.choice((0.0, 3.0)), seed=seed,
                    numel=1024, dishonest=dishonest, attacks=attacks, attacker_prefixes=prefixes, events=events)


def _large(seed: int) -> Scenario:
    rng = random.Random(f"search-large/{seed}")
    n = rng.randint(24, 40)
    f = rng.randint(1, (n - 1) // 3)
    prefixes = rng.randint(1, min(f, 4))
    attacks = tuple(sorted(rng.sample(sorted(FIRST_ATTACKS), rng.choice((1, 1, 2)))))
    dishonest = tuple(sorted(rng.sample(range(n), f)))
    honest = [i for i in range(n) if i not in dishonest]
    events: tuple[Event, ...] = ()
    if rng.random() < 0.4:
        events = (Event(at=round(rng.uniform(3.0, 20.0), 3), kind="crash", peers=(rng.choice(honest),),
                        until=round(rng.uniform(2.0, 10.0), 3)),)
    # round 0 in 2^L ready buckets of 4 to 8 pairs' peers; above 64, heartbeats in buckets too
    expected = rng.choice((n, 2 * n, 4 * n))
    return Scenario(peers=n, rounds=3, target=2, jitter_s=rng.choice((0.0, 3.0)), seed=seed, numel=1024,
                    dishonest=dishonest, attacks=attacks, attacker_prefixes=prefixes, events=events,
                    spec=(("expected_peers", expected),))


def _slow(seed: int) -> Scenario:
    """6 to 12 peers, a quarter to a third of them (honest or not) at a tenth of the others' rate,
    vectors large enough to measure it (rates.py): slow members only send, and reducers relay their
    audit copies; ``tampered_relay`` is drawn half the time, next to any attack of the library."""
    rng = random.Random(f"search-slow/{seed}")
    n = rng.randint(6, 12)
    f = rng.randint(1, (n - 1) // 3)
    prefixes = rng.randint(1, f)
    others = sorted(a for a in SLOW_ATTACKS if a != "tampered_relay")
    attacks = tuple(sorted({"tampered_relay" if rng.random() < 0.5 else rng.choice(others), rng.choice(others)}))
    dishonest = tuple(sorted(rng.sample(range(n), f)))
    honest = [i for i in range(n) if i not in dishonest]
    events: tuple[Event, ...] = ()
    if rng.random() < 0.3:
        events = (Event(at=round(rng.uniform(3.0, 20.0), 3), kind="crash", peers=(rng.choice(honest),),
                        until=round(rng.uniform(2.0, 10.0), 3)),)
    return Scenario(peers=n, rounds=4, target=rng.choice((4, 8)), jitter_s=rng.choice((0.0, 3.0)), seed=seed,
                    numel=1 << 19, slow_fraction=rng.choice((0.25, 0.34)), mbit=20.0, slow_mbit=2.0, down_mbit=20.0,
                    dishonest=dishonest, attacks=attacks, attacker_prefixes=prefixes, events=events)


def _pulled(result: Result) -> dict[str, str]:
    """state hash -> why, for every round an honest peer completed with a mean that I1 forbids."""
    at_base: dict[tuple[int, str], dict[int, Probe]] = {}
    for probe in result.probes:
        at_base.setdefault((probe.round, probe.base), {})[probe.peer] = probe  # (a restart's later one)
    computed: dict[tuple[int, str], dict[int, Probe]] = {}
    for probe in result.attacker_probes:
        computed.setdefault((probe.round, probe.base), {})[probe.peer] = probe
    state = {(i, rec["round"]): rec["state_hash"] for i, rec in result.records
             if rec.get("event") == "round" and not rec.get("void")}
    out: dict[str, str] = {}
    for (round_, base), probes in sorted(at_base.items()):
        reference = list(probes.values())
        if len(reference) < 2:  # (one honest peer alone has no spread: the module's I1)
            reference += computed.get((round_, base), {}).values()
        honest = torch.stack([p.delta for p in reference])  # (h, PROBE_VALUES): computed honestly
        mixed = f", with {len(reference) - len(probes)} attackers' own" if len(reference) > len(probes) else ""
        m = honest.mean(dim=0)
        for p in probes.values():
            if p.applied is None or p.void is None or (p.peer, round_) not in state:
                continue
            keep = ~p.void
            if not keep.any():
                continue
            spread = float((honest[:, keep] - m[keep]).norm(dim=1).max())
            off = float((p.applied[keep] - m[keep]).norm())
            rounding = I1_ROUNDING * float(honest[:, keep].norm(dim=1).max())
            if not off <= I1_BOUND * spread + rounding:  # (NaN fails too)
                out.setdefault(state[(p.peer, round_)],
                               f"peer {p.peer} round {round_}: applied a mean {off / max(spread, 1e-12):.3g} x the "
                               f"largest honest deviation from the honest mean ({len(probes)} honest peers at its base"
                               f"{mixed})")
    return out


def _foreign(result: Result) -> dict[str, str]:
    """state hash -> why, for every state that attackers' rounds computed and no honest peer's did
    (an honest peer on it, or on a state built on it, took the attackers' model: I1)."""
    honest = {p.index for p in result.honest()}
    made = {rec["state_hash"] for i, rec in result.records
            if i in honest and rec.get("event") == "round" and not rec.get("void")}
    out: dict[str, str] = {}
    for i, rec in result.records:
        if (i not in honest and rec.get("event") == "round" and not rec.get("void")
                and rec.get("state_hash") and rec["state_hash"] not in made):
            out.setdefault(rec["state_hash"], f"attacker {i} round {rec['round']}: a state no honest peer computed")
    return out


def _tainted(result: Result) -> dict[str, str]:
    """state hash -> why, for every round an honest peer completed from a group without an honest
    majority, or with a shard an attacker reduced and no honest member audited (I7)."""
    bad = {p.id for p in result.peers if not p.honest}
    honest = {p.index for p in result.honest()}
    out: dict[str, str] = {}
    for i, rec in result.records:
        if i not in honest or rec.get("event") != "round" or rec.get("void"):
            continue
        group = list(rec.get("group", ()))
        attackers = sum(p in bad for p in group)
        if attackers and 2 * attackers >= len(group):
            out.setdefault(rec["state_hash"], f"peer {i} round {rec['round']}: applied a group of {len(group)} "
                                              f"with {attackers} attackers (no honest majority)")
            continue
        reducers, auditors = rec.get("reducers") or [], rec.get("auditors") or []
        for k, (reducer, auditor) in enumerate(zip(reducers, auditors, strict=False)):
            if reducer in bad and (auditor is None or auditor in bad):
                out.setdefault(rec["state_hash"], f"peer {i} round {rec['round']}: shard {k} reduced by an attacker "
                                                  f"and audited by {'nobody' if auditor is None else 'an attacker'}")
                break
    return out


def _containers(obj: Any, depth: int, seen: set[int]) -> Iterator[tuple[str, int]]:
    """(path, entries) of the dicts, sets, lists and deques reachable from ``obj`` by attributes."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for name, value in attrs.items():
        if isinstance(value, dict | set | frozenset | list | tuple) or type(value).__name__ == "deque":
            try:
                yield name, len(value)
            except TypeError:
                continue
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("hivetrain"):
            for path, size in _containers(value, depth - 1, seen):
                yield f"{name}.{path}", size


def check(result: Result) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """([(invariant, summary)] broken, {measured: value}) for one finished run."""
    broken: list[tuple[str, str]] = []
    parent = lineage(result)
    pulled = _foreign(result) | _pulled(result)
    for index, state in sorted(final_states(result).items()):
        hit = pulled.keys() & ancestors(state, parent)
        if hit:
            broken.append(("I1", f"honest peer {index} ends on a state built on: {pulled[min(hit)]}"))
            break
    honest_ids = {p.id: p.index for p in result.honest()}
    for peer in result.honest():
        for incarnation in peer.incarnations:
            for victim, index in honest_ids.items():
                why = incarnation.averager.ctx.bans.why(victim)
                if why is not None:
                    broken.append(("I3", f"honest peer {peer.index} banned honest peer {index}: {why}"))
    for peer in result.peers:
        for incarnation in peer.incarnations[-1:]:
            for path, size in _containers(incarnation, WALK_DEPTH, set()):
                if size > MAX_CONTAINER:
                    broken.append(("I5", f"peer {peer.index} holds {size} entries in {path}"))
    honest = {p.index for p in result.honest()}
    rounds = [rec for i, rec in result.records if i in honest and rec.get("event") == "round"]
    per_round: dict[int, set[str]] = {}
    for rec in rounds:
        per_round.setdefault(rec["round"], set()).add(rec["state_hash"])
    completed = sum(not rec.get("void") for rec in rounds)
    expected = len(honest) * result.scenario.rounds
    deadline = result.scenario.run_spec().allreduce_timeout
    at_deadline = sum(not rec.get("void") and (rec.get("allreduce_s") or 0.0) >= DEADLINE_SHARE * deadline
                      for rec in rounds)
    tainted = _tainted(result)
    measured = {"I2_states_per_round": max((len(v) for v in per_round.values()), default=0),
                "I4_completed_fraction": round(completed / max(1, expected), 4),
                "I6_completed_at_deadline": at_deadline,
                "I7_without_honest_majority": len(tainted)}
    return broken, measured


def story(result: Result, lines: int = 40) -> list[str]:
    """A shortened trace of the run: its faults, every void round and sync, and the last events."""
    faults = [t for t in result.trace if any(w in t for w in ('"crash"', '"start"', '"partition"', '"heal"',
                                                               '"void": true', '"sync"', '"failed"'))][: lines // 2]
    return [*faults, "...", *result.trace[-(lines - len(faults)):]]


def run_one(seed: int) -> tuple[Scenario, Result, list[Violation], dict[str, float]]:
    sc = schedule(seed)
    result = simulate(sc)
    broken, measured = check(result)
    attack = "+".join(sc.attacks)
    return sc, result, [Violation(inv, seed, attack, summary) for inv, summary in broken], measured


def verdict(seed: int) -> tuple[tuple[str, ...], list[str], dict[str, float]]:
    """Schedule ``seed`` run and checked, in plain values (for a process pool): its attacks, one line
    per broken invariant, and its measures."""
    sc, _, found, measured = run_one(seed)
    return sc.attacks, [f"{v.invariant} [{v.attack}]: {v.summary}" for v in found], measured


def search_row(seed: int) -> tuple[dict[str, Any], list[Violation]]:
    """Schedule ``seed`` run and checked, as plain values (for a process pool): its summary row (with
    ``story``, the shortened trace, where an invariant broke) and its violations."""
    sc, result, found, measured = run_one(seed)
    row = {"seed": seed, "peers": sc.peers, "attackers": len(sc.dishonest), "prefixes": sc.attacker_prefixes,
           "attacks": list(sc.attacks), "churn": bool(sc.events), "violations": sorted({v.invariant for v in found}),
           "wall_s": round(result.wall_s, 2), **measured}
    if found:
        row["story"] = story(result, lines=16)
    return row, found


def _log_level(level: int) -> None:
    logging.getLogger("hivetrain").setLevel(level)


def search(budget_s: float, seed: int = 0, progress: Any = None,
           workers: int = 1) -> tuple[int, list[Violation], list[dict[str, Any]]]:
    """Runs schedules seed, seed+1, ... until ``budget_s`` seconds of wall time are spent (at least one);
    returns (schedules run, violations, one summary per schedule: ``search_row``). With ``workers`` > 1
    they run in that many processes; rows come back in seed order, and the seeds run are still one
    range from ``seed`` (the schedules under way when the budget ends are finished, not dropped)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    t0 = time.perf_counter()
    violations: list[Violation] = []
    rows: list[dict[str, Any]] = []

    def take(row: dict[str, Any], found: list[Violation]) -> None:
        violations.extend(found)
        rows.append(row)
        if progress is not None:
            progress(row)

    if workers == 1:
        while not rows or time.perf_counter() - t0 < budget_s:
            take(*search_row(seed + len(rows)))
        return len(rows), violations, rows
    level = logging.getLogger("hivetrain").level  # (the workers keep the caller's: bench.swarm quiets it)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_log_level,
                             initargs=(level,)) as pool:
        pending: deque[Future[tuple[dict[str, Any], list[Violation]]]] = deque()
        submitted = 0
        while pending or not submitted:
            while len(pending) < 2 * workers and (not submitted or time.perf_counter() - t0 < budget_s):
                pending.append(pool.submit(search_row, seed + submitted))
                submitted += 1
            take(*pending.popleft().result())
    return len(rows), violations, rows
