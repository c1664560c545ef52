"""peer status (peer/status.py): what it makes of the run's records, without a network."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from hivetrain.dht.identity import Identity
from hivetrain.dht.records import Envelope, bucket_of, encode_payload, heartbeat_key, ready_key
from hivetrain.peer import join
from hivetrain.peer.config import RunSpec
from hivetrain.peer.state.heartbeats import heartbeat_envelope
from hivetrain.peer.status import heartbeat_ttl, read_matching, read_peers, render, summarize, watch

RUN = "demo.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
SPEC = RunSpec.from_preset("demo", "tiny")
A, B, C = "aa" * 32, "bb" * 32, "cc" * 32


class FakeDHT:
    def __init__(self, records: dict[str, list[Envelope]]):
        self.records = records

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]:
        return self.records.get(key, [])


def beat(identity: Identity, round_: int, state: str, age: float = 0.0, **fields: Any) -> Envelope:
    values: dict[str, Any] = dict(round=round_, state_hash=state, parent="0" * 64, throughput=1000.0,
                                  train_loss=4.0, eval_loss=None)
    values.update(fields)
    return heartbeat_envelope(identity, RUN, heartbeat_ttl(SPEC) - age, **values)


def test_peers_rounds_ages_and_a_heartbeat_in_another_name_skipped() -> None:
    ids = [Identity.generate() for _ in range(4)]
    liar = Identity.generate()
    forged = Envelope.sign(liar, "hb", heartbeat_key(RUN), encode_payload("hb", dict(
        peer_id=ids[0].peer_id, round=99, state_hash=C, parent="0" * 64, throughput=1e9, train_loss=None,
        eval_loss=None)), time.time() + 100)
    dht = FakeDHT({heartbeat_key(RUN): [beat(ids[0], 5, A, age=30, eval_loss=3.5, reach="direct"),
                                        beat(ids[1], 5, A, eval_loss=3.25), beat(ids[2], 4, B, age=10),
                                        beat(ids[3], 10**6, C), forged]})
    peers = read_peers(dht, RUN, SPEC)  # type: ignore[arg-type]
    assert [p.peer_id for p in peers] == [ids[3].peer_id, ids[1].peer_id, ids[0].peer_id, ids[2].peer_id]
    by_id = {p.peer_id: p for p in peers}
    assert by_id[ids[0].peer_id].last_seen_s == pytest.approx(30, abs=2) and by_id[ids[0].peer_id].reachability == "direct"
    assert by_id[ids[2].peer_id].reachability == "unknown" and by_id[ids[0].peer_id].round == 5  # not the forged 99
    status = summarize(RUN, SPEC, peers, {"ready": 1, "announced": 2}, observer="me")
    # the median round and the state most peers hold there: the liar at round 10**6 moves neither
    assert status["round"] == 5 and status["state_hash"] == A and status["agreement"] == 0.5
    assert status["eval_loss"] == pytest.approx(3.375) and status["tokens_per_s"] == 4000.0
    assert status["states"][0] == {"round": 10**6, "state_hash": C, "peers": 1}
    assert {"round": 5, "state_hash": A, "peers": 2} in status["states"]
    assert status["reachability"] == {"direct": 1, "unknown": 3}
    assert status["spec"]["tokens_per_round_per_peer"] == SPEC.sync_every * SPEC.batch_size * SPEC.seq_len
    json.dumps(status)  # --json prints it as is
    text = render(status, [(3, 3.9), (5, 3.375)])
    assert "round 5: 4 peers, 50% hold state aaaaaaaaaaaa" in text and "1 ready, 2 still computing" in text
    assert "by round: 3: 3.900, 5: 3.375" in text and "* another state" in text


def test_an_empty_run_and_the_ready_counts() -> None:
    status = summarize(RUN, SPEC, [])
    assert status["round"] == 0 and status["state_hash"] is None and status["peers"] == [] and status["agreement"] == 0
    assert "0 peers" in render(status)
    ident = Identity.generate()
    ready = [Envelope.sign(ident, "ready", ready_key(RUN, 3), encode_payload("ready", dict(
        peer_id=ident.peer_id, round=3, base_hash=A, spec_hash=B, done=done, eta=0.0)), time.time() + 60)
        for done in (True, False)]
    assert read_matching(FakeDHT({ready_key(RUN, 3): ready}), RUN, 3) == {"ready": 1, "announced": 1}  # type: ignore[arg-type]


def test_watch_prints_json_lines_and_keeps_a_loss_trend() -> None:
    rounds = iter([(1, 4.0), (1, 4.0), (2, 3.5)])

    def read() -> dict[str, Any]:
        r, loss = next(rounds)
        return {**summarize(RUN, SPEC, []), "round": r, "eval_loss": loss}

    out = io.StringIO()
    assert watch(read, True, 0.01, 3, out, sleep=lambda s: None) == 3
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [x["round"] for x in lines] == [1, 1, 2] and lines[-1]["trend"] == [[1, 4.0], [2, 3.5]]
    text = io.StringIO()
    watch(lambda: summarize(RUN, SPEC, []), False, 0.01, 2, text, sleep=lambda s: None)
    assert text.getvalue().count("run demo.") == 2 and "\x1b[" not in text.getvalue()  # not a terminal: no escapes


def test_the_ready_counts_of_a_run_spread_over_buckets() -> None:
    idents = [Identity.generate() for _ in range(5)]
    while bucket_of(3, idents[-1].peer_id, 3) != 0:  # (a reader finds the level in use by its bucket 0)
        idents[-1] = Identity.generate()
    idents.append(Identity.generate())
    keys: dict[str, list[Envelope]] = {}
    for ident in idents:
        key = ready_key(RUN, 3, 3, bucket_of(3, ident.peer_id, 3))
        keys.setdefault(key, []).append(Envelope.sign(ident, "ready", key, encode_payload("ready", dict(
            peer_id=ident.peer_id, round=3, base_hash=A, spec_hash=B, done=True, eta=0.0)), time.time() + 60))
    # 300 peers' heartbeats with target 8 suggest level 3 (per 32: 256 <= 300 < 512)
    assert read_matching(FakeDHT(keys), RUN, 3, 300, 8) == {"ready": 6, "announced": 0}  # type: ignore[arg-type]
    assert read_matching(FakeDHT(keys), RUN, 3, 5, 8) == {"ready": 0, "announced": 0}  # type: ignore[arg-type]


def test_each_peers_totals_and_addresses_from_its_heartbeat_and_a_fresh_join_string() -> None:
    """Step 15: a heartbeat carries its peer's tokens and rounds since its process started and its
    own addresses; status shows each peer's totals and share, and a join string of the live,
    dialable peers on the run's state, one per network prefix, under their own ids."""
    ids = [Identity.generate() for _ in range(5)]
    dht = FakeDHT({heartbeat_key(RUN): [
        beat(ids[0], 5, A, tokens=3000, rounds=3, addrs=["/ip4/81.2.69.160/tcp/31337", "/ip4/10.0.0.1/tcp/31337"],
             reach="direct"),
        beat(ids[1], 5, A, age=20, tokens=1000, rounds=1, addrs=["/ip4/81.2.69.161/tcp/31337"]),  # same /24
        beat(ids[2], 5, A, age=5, addrs=["/ip4/192.0.2.1/tcp/4001"], reach="outbound_only"),  # nobody can dial it
        beat(ids[3], 4, B, addrs=["/ip4/203.0.113.9/tcp/31337"]),  # another state: listed after those on A
        beat(ids[4], 5, A)]})  # (a peer of the previous release: no totals, no addresses)
    peers = read_peers(dht, RUN, SPEC)  # type: ignore[arg-type]
    status = summarize(RUN, SPEC, peers)
    by_id = {p["peer_id"]: p for p in status["peers"]}
    assert status["tokens"] == 4000 and by_id[ids[0].peer_id]["share"] == 0.75
    assert by_id[ids[0].peer_id]["rounds_completed"] == 3 and by_id[ids[4].peer_id]["share"] is None
    fresh = join.fresh(RUN, peers, status["state_hash"])
    assert fresh == join.line(RUN, [f"/ip4/81.2.69.160/tcp/31337/p2p/{ids[0].peer_id}",
                                    f"/ip4/203.0.113.9/tcp/31337/p2p/{ids[3].peer_id}"])
    assert join.parse(fresh) == (RUN, fresh.partition("@")[2].split(","))
    text = render({**status, "join": fresh})
    assert " 3k " in text and " 1k " in text, text  # (each peer's tokens, in few characters)
    assert text.endswith(f"join with: peer start --join {fresh}")
