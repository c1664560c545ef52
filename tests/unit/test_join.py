"""The join string (peer/join.py), where ``peer start`` listens by default (peer/flags.py), and the
heartbeat's ``addrs`` (dht/records.py): pure, in-process. The round trip through real peers is in
tests/integration/test_status.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hivetrain.dht.records import check_payload
from hivetrain.peer import cli, flags, join, reach
from hivetrain.peer.errors import ConfigError
from hivetrain.peer.net.dialback import DIRECT, Verdict

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
KEY = "demo." + "a" * 32
LO, LAN, PUB = (f"/ip4/{ip}/tcp/4001/p2p/{PEER}" for ip in ("127.0.0.1", "192.168.1.2", "81.2.69.160"))


def test_a_join_line_offers_public_addresses_then_lan_ones_and_loopback_only_when_there_is_nothing_else() -> None:
    assert join.pick([LO, LAN, PUB, PUB], 4) == [PUB, LAN]
    assert join.pick([LO, LAN, PUB], 1) == [PUB]
    assert join.pick([LO], 2) == [LO]
    assert join.pick([], 2) == []
    assert join.limited([PUB]) == "" and "private address" in join.limited([LAN]) and "loopback" in join.limited([LO])


def test_a_join_string_round_trips_with_its_key_in_lower_case() -> None:
    text = join.line(KEY.upper(), [PUB, LAN])
    assert text == f"hivetrain://{KEY.upper()}@{PUB},{LAN}"
    assert join.parse(f"  {text} ") == (KEY, [PUB, LAN])
    assert join.parse(text.replace("hivetrain://", "HIVETRAIN://")) == (KEY, [PUB, LAN])


@pytest.mark.parametrize(("text", "says"), [
    (f"{KEY}@{PUB}", "a join string starts with hivetrain://"),
    (f"hivetrain://{KEY}", "no peer address after the run key"),
    (f"hivetrain://{KEY}@ , ", "no peer address after the run key"),
    (f"hivetrain://not-a-key@{PUB}", "--join: run key 'not-a-key' is malformed"),
    (f"hivetrain://{KEY}@/ip4/1.2.3.4/tcp/4001", "has no /p2p/<peer id> part"),
    (f"hivetrain://{KEY}@/ip4/1.2.3.4/udp/4001/p2p/{PEER}", "must name an IP (or DNS) address and a TCP port"),
    (f"hivetrain://{KEY}@" + ",".join([PUB] * 9), "9 addresses, at most 8"),
    (f"hivetrain://{KEY}@" + "x" * 5000, "characters long, at most 4096"),
])
def test_a_bad_join_string_is_one_line_naming_the_flag(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        join.parse(text)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith("--join"), str(e.value)


def test_a_heartbeat_lists_its_own_addresses_without_a_peer_id_and_readers_refuse_anything_else() -> None:
    assert join.own([LO, LAN, PUB]) == ["/ip4/81.2.69.160/tcp/4001", "/ip4/192.168.1.2/tcp/4001"]
    beat = {"peer_id": PEER, "round": 1, "state_hash": "0" * 64, "parent": "0" * 64, "throughput": 1.0,
            "train_loss": None, "eval_loss": None}
    check_payload("hb", beat)  # (it may be left out: a peer of the previous release)
    check_payload("hb", {**beat, "addrs": join.own([LO, LAN, PUB])})
    for bad in ([f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}"], ["/ip4/1.2.3.4/tcp/1"] * 5, ["/ip4/1.2.3.4/udp/1"],
                ["/ip4/" + "1" * 200 + "/tcp/1"], "/ip4/1.2.3.4/tcp/1", [7]):
        with pytest.raises(Exception, match="addrs"):
            check_payload("hb", {**beat, "addrs": bad})


def _start(*argv: str) -> argparse.Namespace:
    args = cli.build_parser().parse_args(["start", *argv])
    flags.check_start(args)
    return args


def test_a_peer_listens_on_all_interfaces_at_the_default_port_unless_told_otherwise(tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path)]
    assert _start("--new-run", "x", "--port", "0", *state).host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert _start("--new-run", "x", "--ephemeral", *state).host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    args = cli.build_parser().parse_args(["start", "--new-run", "x", *state])
    assert flags.listen_on(args) == [f"/ip4/0.0.0.0/tcp/{flags.DEFAULT_PORT}"] == ["/ip4/0.0.0.0/tcp/31337"]
    mine = ["/ip4/127.0.0.1/tcp/0"]
    assert _start("--new-run", "x", "--host-maddrs", *mine, *state).host_maddrs == mine
    for argv, says in ((["--port", "5", "--host-maddrs", *mine], "--port and --host-maddrs: pass one"),
                       (["--port", "70000"], "--port must be a TCP port, 0 to 65535, got 70000"),
                       (["--host-maddrs"], "--host-maddrs needs an address")):
        with pytest.raises(ConfigError, match=says):
            _start("--new-run", "x", *argv, *state)


def test_join_fills_the_run_key_and_the_initial_peers_of_start_status_and_export(tmp_path: Path) -> None:
    text = join.line(KEY.upper(), [LAN])
    args = _start("--join", text, "--initial-peers", PUB, "--port", "0", "--state-dir", str(tmp_path))
    assert (args.run, args.initial_peers) == (KEY, [LAN, PUB])
    status = cli.build_parser().parse_args(["status", "--join", text])
    flags.check_status(status)
    assert (status.run, status.initial_peers) == (KEY, [LAN])
    export = cli.build_parser().parse_args(["export", "--join", text, "--out", str(tmp_path / "out")])
    flags.check_export(export)
    assert export.run == KEY
    plain = cli.build_parser().parse_args(["export", "--run", KEY.upper(), "--out", str(tmp_path / "out")])
    flags.check_export(plain)
    assert plain.run == KEY  # case-insensitive, as everywhere
    with pytest.raises(ConfigError, match="needs the run's join string"):
        flags.check_status(cli.build_parser().parse_args(["status", "--run", KEY]))


def test_the_listening_line_says_where_and_which_port() -> None:
    visible = [f"/ip4/127.0.0.1/tcp/40001/p2p/{PEER}", f"/ip4/10.0.0.2/tcp/40001/p2p/{PEER}"]
    assert reach.listening(["/ip4/0.0.0.0/tcp/0"], visible) == (
        "listening on all interfaces, TCP port 40001 (--port chooses another)")
    assert reach.listening(["/ip4/127.0.0.1/tcp/0"], visible[:1]) == (
        "listening on 127.0.0.1 only, TCP port 40001 (only this machine can reach it) "
        "(--port N listens on all interfaces)")


def test_a_peer_gives_out_the_public_address_its_dialers_saw_once() -> None:
    public = Verdict(DIRECT, (("a", True), ("b", True)), (31337,), 2, "81.2.69.160")
    assert join.learnt(public, ["/ip4/192.168.1.2/tcp/31337"]) == "/ip4/81.2.69.160/tcp/31337"
    assert join.learnt(public, ["/ip4/81.2.69.160/tcp/31337"]) is None  # listed already
    for nothing in (Verdict(DIRECT, (), (31337,), 2, "192.168.1.9"), Verdict(DIRECT, (), (31337,), 2, ""),
                    Verdict(DIRECT, (), (), 2, "81.2.69.160")):
        assert join.learnt(nothing, []) is None  # a private IP, none, or no port
    assert join.learnt(Verdict(DIRECT, (), (4001,), 1, "2001:4860::8888"), []) == "/ip6/2001:4860::8888/tcp/4001"
