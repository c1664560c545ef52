"""Matchmaking windows that end at different times, with real P2PAverager instances on 127.0.0.1.

Both tests reproduce one CI flake: a member that the others had already grouped with (it answered
their view requests with the same members) was still busy before or inside its own matchmaking
window while they sent their parts; it came out after their all-reduce deadline, heard "decided
without you" and trained alone, while they voided at the deadline waiting for its parts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.node import DHT, DHTOptions
from hivetrain.peer.averaging.averager import P2PAverager
from hivetrain.peer.config import RunSpec
from hivetrain.peer.errors import RoundFailed
from hivetrain.peer.faults import FaultPlan

pytestmark = pytest.mark.timeout(120)
WINDOW, DEADLINE = 8.0, 3.0
NUMEL = 50_000
BASE = "ef" * 32


@pytest.fixture
def averagers() -> Iterator[Callable[[int], list[P2PAverager]]]:
    dhts: list[DHT] = []

    def make(target: int) -> list[P2PAverager]:
        spec = RunSpec(name="window", target_group_size=target, matchmaking_timeout=WINDOW, allreduce_timeout=DEADLINE)
        run_key = make_run_key(spec.name, Identity.generate().public_key)
        for _ in range(3):
            initial = tuple(dhts[0].visible_maddrs()[:1]) if dhts else ()
            dhts.append(DHT(DHTOptions(initial_peers=initial, timeout=10.0)).start())
        return [P2PAverager(dht, Identity.generate(), run_key, spec, NUMEL, FaultPlan()).start() for dht in dhts]

    yield make
    for dht in reversed(dhts):
        dht.shutdown()


def _round(averagers: list[P2PAverager], delays: list[float]) -> tuple[dict[str, Any], dict[str, float]]:
    """Every averager runs round 0 in its own thread after its delay; returns results and start times."""
    outcome: dict[str, Any] = {}
    entered: dict[str, float] = {}

    def run(name: str, averager: P2PAverager, delay: float) -> None:
        time.sleep(delay)
        entered[name] = time.monotonic()
        delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(ord(name)))
        try:
            outcome[name] = averager.average(0, BASE, delta)
        except RoundFailed as e:
            outcome[name] = e

    threads = [threading.Thread(target=run, args=(name, av, d)) for name, av, d in zip("abc", averagers, delays, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WINDOW * 3 + DEADLINE + 30)
    assert not any(t.is_alive() for t in threads)
    return outcome, entered


def _one_group_of_three(outcome: dict[str, Any]) -> None:
    failed = {name: str(r) for name, r in outcome.items() if isinstance(r, RoundFailed)}
    assert not failed, failed
    groups = {name: r.group for name, r in outcome.items()}
    assert len(set(groups.values())) == 1 and len(groups["a"]) == 3, groups
    assert torch.equal(outcome["a"].averaged, outcome["b"].averaged)
    assert torch.equal(outcome["a"].averaged, outcome["c"].averaged)


def test_a_late_window_adopts_the_group_that_already_waits_for_it(averagers) -> None:
    """A target of four is never reached, so every window runs to its end. A and C enter together,
    B a few seconds later; when A's window ends it asks B, which is still inside its window and
    answers with the same three members: A and C decide and send their parts. B's own window would
    end after their deadline; a part from a member now closes it, and B adopts their decision."""
    late = 4.0  # B's window would end at late + WINDOW, after A's at WINDOW plus the deadline
    outcome, entered = _round(averagers(4), [0.0, late, 0.0])
    assert entered["b"] - entered["a"] < WINDOW - 1.0, entered  # B really was inside its window
    _one_group_of_three(outcome)
    assert outcome["b"].stats["matchmaking_s"] < WINDOW - 1.0, outcome["b"].stats  # it did not wait it out


def test_a_slow_ready_record_store_does_not_hold_back_matchmaking(averagers) -> None:
    """B's ready record lands, but its DHT store call then hangs (as one did in CI on a young DHT):
    A and C find B, B answers their view requests, the three decide at once. The store used to run
    before B's window, for up to the whole window; B then came out after the deadline."""
    a, b, c = averagers(3)
    store = b.dht.astore

    async def slow_store(envelope: Any) -> bool:
        await store(envelope)
        await asyncio.sleep(3 * WINDOW)
        return False

    b.dht.astore = slow_store  # type: ignore[method-assign]
    outcome, _ = _round([a, b, c], [0.0, 0.0, 0.0])
    _one_group_of_three(outcome)


def test_a_dropped_view_request_is_asked_again(averagers) -> None:
    """B's first view request to each peer fails at once, like a stream p2pd dropped (seen in CI:
    one peer then trained alone for a round while the other three formed a group)."""
    a, b, c = averagers(3)
    request, failed = b._request, set()

    async def flaky_request(peer: str, header: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if header["type"] == "view" and peer not in failed:
            failed.add(peer)
            raise ConnectionResetError("stream reset by p2pd")
        return await request(peer, header, *args, **kwargs)

    b._request = flaky_request  # type: ignore[method-assign]
    outcome, _ = _round([a, b, c], [0.0, 0.0, 0.0])
    assert failed, "B never asked for a view"
    _one_group_of_three(outcome)


def test_an_exclusion_spread_by_an_outsider_does_not_split_a_decided_group(averagers) -> None:
    """A has caught C earlier (banned) and decides {A, B} while B is still inside its window. C then
    hears "decided without you" from A, excludes A, and its next view request spreads that
    exclusion to B (views merge by union). B's view now holds only B; it used to decide alone
    while A voided at its deadline (seen in CI with the per-prefix cap dropping one peer). A's part
    shows B that A decided a group with it: B asks A directly and adopts that group."""
    a, b, c = averagers(4)
    a._banned[c.me] = "round -1: (test) caught earlier"
    outcome, _ = _round([a, b, c], [0.0, 2.0, 0.0])
    assert not isinstance(outcome["a"], RoundFailed) and not isinstance(outcome["b"], RoundFailed), outcome
    assert outcome["a"].group == outcome["b"].group and set(outcome["a"].group) == {a.me, b.me}
    assert torch.equal(outcome["a"].averaged, outcome["b"].averaged)
    assert b._views[0].excluded >= {a.me, c.me}, b._views[0].excluded  # the spread really happened
