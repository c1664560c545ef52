"""Uplink claims and the reduce shares derived from them (peer/averaging/rates.py, session.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hivetrain.peer.averaging import rates
from hivetrain.peer.averaging.api import group_hash
from hivetrain.peer.averaging.rates import Meter, Rates, deal, quantize, slow, weights
from hivetrain.peer.averaging.session import RoundSession
from hivetrain.peer.config import RunSpec

CODEC = RunSpec("rates").codec()
MEMBERS = tuple(f"peer{i}" for i in range(6))


def session(claims: dict[str, int] | None = None, closed: frozenset[str] = frozenset(), me: str = "peer0",
            units_values: int = 1 << 12) -> RoundSession:
    return RoundSession("run", 3, "b" * 64, MEMBERS, me, 1 << 16, CODEC, True, 0.0, units_values, closed, claims)


def test_claims_are_kilobytes_per_second_with_two_significant_digits() -> None:
    assert quantize(0.0) == 0 and quantize(999.0) == 0
    assert quantize(1_000.0) == 1
    assert quantize(12_345_678.0) == 12_000
    assert quantize(2_560_000.0) == 2_600
    assert quantize(1e15) == rates.MAX_CLAIM


def test_the_meter_reads_the_uplink_off_the_first_half_of_the_parts() -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        meter = Meter()
        meter.begin()
        t0 = loop.time()
        # four 1 MB parts leave at 10 MB/s to fast receivers; the fifth trickles into a slow one
        for k in range(4):
            await asyncio.sleep(max(0.0, t0 + 0.1 * (k + 1) - loop.time()))
            meter.delivered(1_000_000)
        await asyncio.sleep(max(0.0, t0 + 2.0 - loop.time()))
        meter.delivered(1_000_000)
        meter.delivered(100)  # a verdict-sized body says nothing
        return meter.uplink()

    up = asyncio.run(scenario())
    assert 8e6 < up < 11e6, up  # ~3 MB in 0.3 s; the slow receiver's part is past the half


def test_the_estimate_is_the_median_of_recent_rounds_and_off_claims_nothing() -> None:
    r = Rates()
    for rate in (2e6, 50e6, 3e6):
        meter = Meter(started=0.0, done=[(1.0, int(rate))])
        r.observe(meter)
    assert r.claim() == quantize(3e6)  # the odd round (50 MB/s) does not move it
    r.observe(Meter())  # nothing measured: no change
    assert r.claim() == quantize(3e6)
    assert Rates(enabled=False, recent=[5e6]).claim() == 0


def test_equal_claims_deal_the_shards_as_before() -> None:
    for claims in (None, {}, dict.fromkeys(MEMBERS, 5_000)):
        s = session(claims)
        n = len(s.reducers)
        assert s.reducers == MEMBERS and not s.slow
        assert [s.reducer(k) for k in range(s.units)] == [MEMBERS[k % n] for k in range(s.units)]
        assert [s.auditor(k) for k in range(s.units)] == [MEMBERS[(k + 1) % n] for k in range(s.units)]
    assert session(None).group == session(dict.fromkeys(MEMBERS, 0)).group == group_hash(MEMBERS, 3, "b" * 64)


def test_a_slow_member_only_sends_and_the_others_share_by_their_claims() -> None:
    claims = {"peer0": 10_000, "peer1": 10_000, "peer2": 20_000, "peer3": 10_000, "peer4": 10_000, "peer5": 2_000}
    s = session(claims)
    assert s.slow == {"peer5"} and "peer5" not in s.reducers
    shares = Counter(s.reducer(k) for k in range(s.units))
    assert "peer5" not in shares and "peer5" not in {s.auditor(k) for k in range(s.units)}
    assert shares["peer2"] == pytest.approx(2 * shares["peer0"], abs=1)  # twice the claim, twice the shards
    for k in range(s.units):  # every shard is audited, never by its own reducer
        assert s.auditor(k) is not None and s.auditor(k) != s.reducer(k)
    # the roles are part of the group's name: a member that derived other claims refuses our messages
    assert s.group != session({**claims, "peer5": 3_000}).group != session(None).group


def test_a_lie_high_takes_a_bounded_share_and_unknown_claims_count_as_the_median() -> None:
    w = weights(MEMBERS, {"peer0": 10**8, "peer1": 1_000, "peer2": 1_000, "peer3": 1_000})
    assert w["peer0"] == rates.MAX_OVER_MEDIAN * 1_000  # capped
    assert w["peer4"] == w["peer5"] == 1_000  # unknown: the median
    assert slow(MEMBERS, {"peer0": 1_000}) == frozenset()  # one claim is no median
    assert set(deal(("a", "b"), {"a": 4.0, "b": 1.0}, 10)) == {"a", "b"}
    s = RoundSession("run", 3, "b" * 64, ("a", "b"), "a", 2048, CODEC, True, 0.0, 1 << 20,
                     frozenset(), {"a": 5_000, "b": 1_000})
    assert not s.slow and s.reducers == ("a", "b")  # b is slow, but a pair needs both: one reduces, one audits
    assert s.units == 2 and {s.reducer(0), s.reducer(1)} == {"a"}  # a took both shards (5x the claim, capped 4x) ...
    assert s.auditor(0) == s.auditor(1) == "b"  # ... and b audits them
    assert slow(("a", "b", "c", "d"), {"a": 9_000, "b": 100, "c": 200, "d": 9_000}) == {"b", "c"}


def test_closed_and_slow_members_together_leave_the_fast_open_ones_to_reduce() -> None:
    claims = dict.fromkeys(MEMBERS, 8_000) | {"peer4": 1_000}
    s = session(claims, closed=frozenset({"peer5"}))
    assert s.reducers == ("peer0", "peer1", "peer2", "peer3")
    me = session(claims, closed=frozenset({"peer5"}), me="peer4")
    assert me.mine == [] and me.audited == []
