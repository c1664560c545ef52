"""StateSync and StateKeeper (peer/state/sync.py) in-process, with fake DHT, daemon and streams:
bound heartbeats only, a joiner's prefix count over its own connections, NaN states refused,
serving capped per authenticated requester, reply writes with a deadline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hivetrain.dht.identity import Identity, make_run_key
from hivetrain.dht.records import Envelope, encode_payload, heartbeat_key
from hivetrain.peer.net.wire import encode_frame, read_frame
from hivetrain.peer.state import sync as sync_module
from hivetrain.peer.state.choose import Attestation, Attested, Choice, Clock, Own, State
from hivetrain.peer.state.heartbeats import heartbeat_envelope
from hivetrain.peer.state.snapshot import Snapshot
from hivetrain.peer.state.sync import (
    MAX_PER_REQUESTER,
    MAX_SERVING,
    PoisonedState,
    StateKeeper,
    StateSync,
)
from hivetrain.peer.trust import RAMP, Trust

NUMEL = 64
RUN_KEY = make_run_key("sync", Identity.generate().public_key)
SPEC = "5e" * 32


class NoFaults:
    def active(self, point: str, round_: int) -> bool:
        return False


@dataclass
class _Id:
    value: str

    def to_base58(self) -> str:
        return self.value


@dataclass
class _Info:  # what p2pd's list_peers returns: one entry per connection
    peer_id: _Id
    addrs: list[str]


class FakeP2P:
    def __init__(self, addrs: dict[str, str]):
        self.addrs = addrs

    async def list_peers(self) -> list[_Info]:
        return [_Info(_Id(p), [a]) for p, a in self.addrs.items()]


class FakeDHT:
    def __init__(self, me: Identity, envelopes: list[Envelope], addrs: dict[str, str] | None = None):
        self.peer_id, self.envelopes, self.p2p = me.peer_id, envelopes, FakeP2P(addrs or {})
        self.remembered: list[str] = []

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]:
        assert key == heartbeat_key(RUN_KEY)
        return list(self.envelopes)

    def remember_threadsafe(self, peer_ids: Any) -> None:
        self.remembered.extend(peer_ids)

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run(coro)


def snapshot(seed: int, round_: int = 5, parent: str = "0" * 64, nan: bool = False) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    master, momentum = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    if nan:
        master[7] = float("nan")
    return Snapshot.of(round_, master, momentum, parent=parent, link="1" * 64)


def hb(identity: Identity, snap: Snapshot) -> Envelope:
    return heartbeat_envelope(identity, RUN_KEY, 60.0, round=snap.round, state_hash=snap.hash, parent=snap.parent,
                              throughput=1.0, train_loss=None, eval_loss=None)


def serving(sync: StateSync, held: dict[str, Snapshot]) -> None:
    """Replaces the network: each donor serves the snapshot it holds (or refuses)."""
    async def fetch(donor: str, target: Any, index: int, max_body: int) -> bytes:
        snap = held.get(donor)
        if snap is None or snap.hash != target.hash:
            raise ConnectionError("no such state here")
        return snap.manifest() if index == -1 else snap.piece(index)

    sync._fetch = fetch  # type: ignore[method-assign]


# ---- heartbeats bound to their signer -------------------------------------------------------------


def test_wait_for_peers_counts_bound_identities_only() -> None:
    me, a, b, liar = (Identity.generate() for _ in range(4))
    snap = snapshot(0)
    forged = []
    for named in (a.peer_id, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", Identity.generate().peer_id):
        fields = dict(peer_id=named, round=5, state_hash=snap.hash, parent=snap.parent, throughput=0.0,
                      train_loss=None, eval_loss=None)
        forged.append(Envelope.sign(liar, "hb", heartbeat_key(RUN_KEY), encode_payload("hb", fields), time.time() + 60))
    dht = FakeDHT(me, [hb(me, snap), hb(a, snap), hb(b, snap), *forged])
    keeper = StateKeeper(StateSync(dht, RUN_KEY, SPEC, NUMEL, NoFaults()), Trust(), None, 1.0, 0.2)  # type: ignore[arg-type]
    assert keeper.wait_for_peers(10, timeout=0.0) == 3  # me, a, b: the liar's three claims count for nothing


def test_a_heartbeat_can_only_be_signed_in_the_signers_name() -> None:
    me, other = Identity.generate(), Identity.generate()
    with pytest.raises(Exception, match="only name the peer that signs it"):
        heartbeat_envelope(me, RUN_KEY, 60.0, peer_id=other.peer_id, round=1, state_hash="0" * 64,
                           parent="0" * 64, throughput=0.0, train_loss=None, eval_loss=None)


# ---- a joiner counts prefixes over its own connections --------------------------------------------


def test_a_joiner_takes_the_state_attested_from_more_prefixes() -> None:
    me = Identity.generate()
    honest, liars = [Identity.generate() for _ in range(3)], [Identity.generate() for _ in range(4)]
    good, evil = snapshot(1), snapshot(2, round_=10**9)
    mute = Identity.generate()  # attests the honest state but serves nothing: no vote
    addrs = {p.peer_id: f"/ip4/{a}/tcp/4001" for p, a in zip(honest, ("203.0.113.5", "198.51.100.5", "192.0.2.5"),
                                                               strict=True)}
    addrs |= {p.peer_id: f"/ip4/100.20.0.{i + 1}/tcp/4001" for i, p in enumerate(liars)}  # one /24
    addrs[mute.peer_id] = "/ip4/100.30.0.1/tcp/4001"
    dht = FakeDHT(me, [hb(p, good) for p in honest] + [hb(p, evil) for p in liars] + [hb(mute, good)], addrs)
    sync = StateSync(dht, RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
    serving(sync, {p.peer_id: good for p in honest} | {p.peer_id: evil for p in liars})
    mine = Own(me.peer_id, State(0, "ab" * 32, "0" * 64))
    choice = sync.check(mine, {}, Clock(0.2, 0.0))
    assert choice.target is not None and choice.target.hash == good.hash
    assert set(choice.target.attesters) == {p.peer_id for p in honest}
    assert choice.detail == "attested by 3 network prefixes/IPs (3 identities)"
    assert mute.peer_id not in dht.remembered and set(dht.remembered) == set(addrs) - {mute.peer_id}


def test_an_established_peer_remembers_only_peers_it_trusts() -> None:
    me, friend, stranger = (Identity.generate() for _ in range(3))
    mine = snapshot(0)
    dht = FakeDHT(me, [hb(friend, mine), hb(stranger, snapshot(3, round_=6, parent=mine.hash))])
    sync = StateSync(dht, RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
    own = Own(me.peer_id, State(5, mine.hash, mine.parent))
    assert sync.check(own, {friend.peer_id: 1.0}, Clock(0.2, 1.0)).target is None
    assert dht.remembered == [friend.peer_id]


# ---- downloads ------------------------------------------------------------------------------------


def test_a_state_holding_nan_is_refused_and_its_donor_named() -> None:
    me = Identity.generate()
    bad = snapshot(4, nan=True)
    sync = StateSync(FakeDHT(me, []), RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
    serving(sync, {"d1": bad, "d2": bad})
    target = Attested(bad.round, bad.hash, bad.parent, ("d1", "d2"))
    with pytest.raises(PoisonedState, match=r"NaN or Inf: served by d[12] \(piece 0\)") as caught:
        asyncio.run(sync._download(target))
    assert caught.value.state_hash == bad.hash
    good = snapshot(5)
    serving(sync, {"d1": good})
    assert asyncio.run(sync._download(Attested(good.round, good.hash, good.parent, ("d1",)))) == good


def test_a_manifest_with_another_parent_than_announced_is_refused() -> None:
    me, good = Identity.generate(), snapshot(6)
    sync = StateSync(FakeDHT(me, []), RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
    serving(sync, {"d1": good})
    with pytest.raises(sync_module.StateSyncFailed, match="parent"):
        asyncio.run(sync._download(Attested(good.round, good.hash, "7" * 64, ("d1",))))


class FakeSync:
    def __init__(self, choice: Choice, error: Exception | None = None):
        self.choice, self.error, self.calls = choice, error, []
        self.dht = type("D", (), {"peer_id": "me"})()
        self.run_key = "run"
        self.served: list[Snapshot] = []
        self.reach: dict[str, int] = {}  # the reachability mix of the heartbeats last read

    def check(self, own: Own, weights: dict[str, float], clock: Clock, exclude: Any = ()) -> Choice:
        self.calls.append((own, dict(weights), clock, set(exclude)))
        return self.choice

    def download(self, target: Attested, timeout: float) -> Snapshot:
        assert self.error is not None
        raise self.error

    def serve(self, snap: Snapshot) -> None:
        self.served.append(snap)


def test_the_keeper_logs_refused_claims_once_and_never_retries_a_poisoned_state() -> None:
    target = Attested(6, "ee" * 32, "0" * 64, ("t1",))
    fake = FakeSync(Choice(target, (("s1", "claims round 1000000000, beyond 12 that time allows"),), "x",
                           (("t1", 6),)),
                    PoisonedState("ee" * 32, "state eeeeeeeeeeee holds NaN or Inf"))
    trust, said = Trust(), []
    trust.record_completed(1, ["me", "t1"], "me")
    keeper = StateKeeper(fake, trust, None, 1.0, 0.2, log=said.append)  # type: ignore[arg-type]
    keeper.committed(snapshot(0))
    assert keeper.catch_up(5, snapshot(0).hash) is None
    assert keeper.catch_up(5, snapshot(0).hash) is None
    assert sum("refused the heartbeat of s1" in line for line in said) == 1, said
    own, weights, clock, exclude = fake.calls[-1]
    assert own.state == State(5, snapshot(0).hash, "0" * 64) and own.history == (own.state,)
    assert weights == {"t1": pytest.approx(1 / RAMP)} and exclude == {"ee" * 32}
    assert clock.min_round_s == 0.2 and 0 <= clock.since_boundary < 5
    assert fake.calls[0][2].seen == {} and set(clock.seen) == {"t1"} and clock.seen["t1"][0] == 6
    assert fake.calls[0][1] == weights and "ee" * 32 not in fake.calls[0][3]


def test_the_keeper_passes_the_partners_of_our_state_to_fork_choice() -> None:
    fake = FakeSync(Choice(None))
    keeper = StateKeeper(fake, Trust(), None, 1.0, 0.2, log=lambda _: None)  # type: ignore[arg-type]
    keeper.catch_up(3, "ab" * 32, partners=("me", "t1"))
    keeper.catch_up(3, "ab" * 32)
    assert fake.calls[0][0].partners == {"me", "t1"} and fake.calls[1][0].partners == frozenset()


def test_waiting_for_a_rounds_end_does_not_wait_for_a_dead_peer_once_the_others_said(monkeypatch) -> None:
    """A peer that died in the round never publishes: once one awaited peer said how the round
    ended, the rest get END_GRACE more seconds, not the whole wait (we would miss their next group)."""
    t0 = time.monotonic()
    said = {"A": 0.0, "B": 0.3}  # seconds after the start at which each publishes round 4

    def heartbeats(dht: Any, run_key: str) -> list[Any]:
        now = time.monotonic() - t0
        return [Attestation(p, State(4 if now >= at else 3, "ab" * 32, "0" * 64)) for p, at in said.items()] \
            + [Attestation("dead", State(3, "cd" * 32, "0" * 64))]

    monkeypatch.setattr(sync_module, "read_heartbeats", heartbeats)
    monkeypatch.setattr(sync_module, "attestations", lambda found: found)
    monkeypatch.setattr(sync_module, "END_GRACE", 1.0)
    keeper = StateKeeper(FakeSync(Choice(None)), Trust(), None, 1.0, 0.2, log=lambda _: None)  # type: ignore[arg-type]
    assert keeper.wait_for_end(3, ("A", "B", "dead"), time.monotonic() + 60) == ["dead"]
    assert time.monotonic() - t0 < 10  # the grace, not the 60 s bound
    assert keeper.wait_for_end(3, ("A", "B"), time.monotonic() + 60) == []  # all said: no grace at all
    said["B"] = 1e9  # B never says: it is named once the grace is over
    assert keeper.wait_for_end(3, ("A", "B"), time.monotonic() + 60) == ["B"]
    t1 = time.monotonic()
    assert keeper.wait_for_end(3, ("dead",), t1 + 1.0) == ["dead"] and time.monotonic() - t1 >= 1.0  # nobody said


def test_a_keeper_without_history_asks_as_a_joiner() -> None:
    fake = FakeSync(Choice(None))
    keeper = StateKeeper(fake, Trust(), None, 1.0, 0.2, log=lambda _: None)  # type: ignore[arg-type]
    assert keeper.catch_up(0, "ab" * 32) is None
    assert fake.calls[0][1] == {}


# ---- serving --------------------------------------------------------------------------------------


class FakeWriter:
    def __init__(self, stall: bool = False):
        self.data, self.stall, self.closed, self.aborted = bytearray(), stall, False, False
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        if self.stall:  # a requester that never reads
            await asyncio.Event().wait()

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


def _request(snap: Snapshot, index: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(encode_frame({"type": "state_req", "run": SPEC, "round": snap.round, "base": snap.hash,
                                   "index": index}))
    return reader


async def _reply_of(writer: FakeWriter) -> tuple[dict[str, Any], bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(writer.data))
    reader.feed_eof()
    return await read_frame(reader, 1.0, max_body=1 << 21)


def test_serving_is_capped_per_authenticated_requester_and_in_total() -> None:
    async def scenario() -> None:
        sync = StateSync(FakeDHT(Identity.generate(), []), RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
        snap = snapshot(7)
        sync.serve(snap)
        # requests that never send their header hold their slots (each for its 10 s read deadline)
        hogs = [asyncio.create_task(sync._handle(type("S", (), {"peer_id": _Id("hog")})(), asyncio.StreamReader(),
                                                 FakeWriter())) for _ in range(MAX_PER_REQUESTER)]
        await asyncio.sleep(0.01)
        refused = FakeWriter()
        await asyncio.wait_for(sync._handle(type("S", (), {"peer_id": _Id("hog")})(), _request(snap, 0), refused), 1)
        header, _ = await _reply_of(refused)
        assert (header["ok"], header["reason"]) == (False, "busy: too many requests")
        served = FakeWriter()  # another requester is still served, whatever the header claims
        await asyncio.wait_for(sync._handle(type("S", (), {"peer_id": _Id("other")})(), _request(snap, 0), served), 1)
        header, body = await _reply_of(served)
        assert header["ok"] and body == snap.piece(0)
        sync._serving += MAX_SERVING  # the total cap (on top of the hogs)
        full = FakeWriter()
        await asyncio.wait_for(sync._handle(type("S", (), {"peer_id": _Id("third")})(), _request(snap, -1), full), 1)
        assert (await _reply_of(full))[0]["reason"].startswith("busy")
        sync._serving -= MAX_SERVING
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        assert sync._serving == 0 and not sync._by_peer  # every slot given back

    asyncio.run(scenario())


def test_a_requester_that_never_reads_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_module, "WRITE_TIMEOUT", 0.05)

    async def scenario() -> None:
        sync = StateSync(FakeDHT(Identity.generate(), []), RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
        snap = snapshot(8)
        sync.serve(snap)
        writer = FakeWriter(stall=True)
        t0 = time.monotonic()
        await asyncio.wait_for(sync._handle(type("S", (), {"peer_id": _Id("slow")})(), _request(snap, 0), writer), 2)
        assert time.monotonic() - t0 < 1.0 and writer.aborted and sync._serving == 0

    asyncio.run(scenario())


def test_the_keeper_says_the_runs_reachability_mix_when_it_changes() -> None:
    fake = FakeSync(Choice(None))
    said: list[str] = []
    keeper = StateKeeper(fake, Trust(), None, 1.0, 0.2, log=said.append)  # type: ignore[arg-type]
    fake.reach = {"direct": 1, "outbound_only": 2}
    keeper.catch_up(0, "ab" * 32)
    keeper.catch_up(0, "ab" * 32)  # the same mix again: not repeated
    fake.reach = {"direct": 2, "outbound_only": 2}
    keeper.catch_up(0, "ab" * 32)
    assert said == ["peers of the run, as their heartbeats say: 1 reachable directly, 2 outbound-only (behind NAT)",
                    "peers of the run, as their heartbeats say: 2 reachable directly, 2 outbound-only (behind NAT)"]


def test_a_lost_manifest_stream_gets_one_more_chance_and_a_refusal_none() -> None:
    """CI saw a donor's stream close before its manifest reply (IncompleteReadError, 0 bytes) with
    only that donor to ask: the download failed though the donor then served fine."""
    me, good = Identity.generate(), snapshot(8)
    sync = StateSync(FakeDHT(me, []), RUN_KEY, SPEC, NUMEL, NoFaults())  # type: ignore[arg-type]
    asked: list[tuple[str, int]] = []

    def flaky(lose: int, refuse: bool = False) -> None:
        async def fetch(donor: str, target: Any, index: int, max_body: int) -> bytes:
            asked.append((donor, index))
            if refuse:
                raise sync_module.StateMismatch("donor refused: state not held here")
            if index == -1 and sum(1 for a in asked if a[1] == -1) <= lose:
                raise asyncio.IncompleteReadError(b"", 16)
            return good.manifest() if index == -1 else good.piece(index)

        sync._fetch = fetch  # type: ignore[method-assign]

    target = Attested(good.round, good.hash, good.parent, ("d1",))
    flaky(lose=1)
    assert asyncio.run(sync._download(target)) == good and asked.count(("d1", -1)) == 2
    asked.clear()
    flaky(lose=2)
    with pytest.raises(sync_module.StateSyncFailed, match=r"IncompleteReadError.*\(twice\)"):
        asyncio.run(sync._download(target))
    asked.clear()
    flaky(lose=0, refuse=True)
    with pytest.raises(sync_module.StateSyncFailed, match="state not held here"):
        asyncio.run(sync._download(target))
    assert asked == [("d1", -1)]  # a refusal is not asked again
