"""Coming back at the same address (peer/reach.py) and plain-words bootstrap errors (dht/diagnose.py)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from multiaddr import Multiaddr

from hivetrain.dht.diagnose import diagnose
from hivetrain.dht.errors import BootstrapError
from hivetrain.peer import reach
from hivetrain.peer.net.dialback import DIRECT, OUTBOUND_ONLY, UNKNOWN, Verdict
from hivetrain.peer.reach import Reachability, describe

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP socket listening on a free loopback port (a stand-in for another peer's p2pd)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_in_use_is_one_line_naming_it(listener: int) -> None:
    with pytest.raises(BootstrapError, match=f"port {listener} on 127.0.0.1 is already in use") as e:
        reach.check_ports(["/ip4/127.0.0.1/tcp/0", f"/ip4/127.0.0.1/tcp/{listener}"])
    assert "\n" not in str(e.value)
    reach.check_ports(["/ip4/127.0.0.1/tcp/0", f"/ip4/127.0.0.1/tcp/{free_port()}"])  # free ports pass


def test_the_port_is_remembered_per_ip_and_reused_while_free(tmp_path: Path) -> None:
    hosts = ["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/0"]
    assert reach.remembered(str(tmp_path), hosts) == hosts  # nothing saved yet
    a, b = free_port(), free_port()
    reach.remember(str(tmp_path), hosts, [f"/ip4/127.0.0.1/tcp/{a}/p2p/{PEER}", f"/ip4/10.1.2.3/tcp/{b}/p2p/{PEER}"])
    saved = json.loads((tmp_path / reach.LISTEN_FILE).read_text())["ports"]
    assert saved == {"127.0.0.1": a, "0.0.0.0": a}  # a wildcard takes the port of any address of its family
    assert reach.remembered(str(tmp_path), hosts) == [f"/ip4/127.0.0.1/tcp/{a}", f"/ip4/0.0.0.0/tcp/{a}"]
    assert reach.remembered(str(tmp_path), ["/ip4/127.0.0.1/tcp/4444"]) == ["/ip4/127.0.0.1/tcp/4444"]  # explicit wins


def test_a_remembered_port_now_taken_falls_back_to_a_new_one(tmp_path: Path, listener: int) -> None:
    reach.remember(str(tmp_path), ["/ip4/127.0.0.1/tcp/0"], [f"/ip4/127.0.0.1/tcp/{listener}"])
    assert reach.remembered(str(tmp_path), ["/ip4/127.0.0.1/tcp/0"]) == ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.parametrize("content", ["not json", "[]", '{"ports": {"127.0.0.1": "x", "1.2.3.4": 70000}}'])
def test_a_malformed_listen_file_is_ignored(tmp_path: Path, content: str) -> None:
    (tmp_path / reach.LISTEN_FILE).write_text(content)
    assert reach.remembered(str(tmp_path), ["/ip4/127.0.0.1/tcp/0"]) == ["/ip4/127.0.0.1/tcp/0"]


def test_diagnose_tells_nothing_listening_from_the_wrong_peer(listener: int) -> None:
    closed = free_port()
    nobody = diagnose([Multiaddr(f"/ip4/127.0.0.1/tcp/{closed}/p2p/{PEER}")], timeout=2)
    assert nobody == f"nothing listens at 127.0.0.1 port {closed} (the peer stopped, or the port is wrong)"
    someone = diagnose([Multiaddr(f"/ip4/127.0.0.1/tcp/{listener}/p2p/{PEER}")], timeout=2)
    assert someone.startswith(f"127.0.0.1 port {listener} accepts connections, but no libp2p peer 12D3KooWDpJ7As7B")
    assert "peer id is wrong" in someone


def test_the_join_line_offers_a_public_address_then_a_lan_one_never_loopback_first() -> None:
    lo, lan, pub = (f"/ip4/{ip}/tcp/4001/p2p/{PEER}" for ip in ("127.0.0.1", "192.168.1.2", "81.2.69.160"))
    assert reach.best_address([lo, lan, pub]) == pub
    assert reach.best_address([lo, lan]) == lan
    assert reach.best_address([lo]) == lo
    assert reach.best_address([]) is None


class _FakeDHT:
    """Returns scripted dial-back verdicts instead of asking peers."""

    def __init__(self, verdicts: list[Verdict]):
        self.verdicts, self.p2p = list(verdicts), None

    def visible_maddrs(self) -> list[str]:
        return ["/ip4/192.168.1.2/tcp/4040/p2p/x"]

    def run(self, coro, timeout):  # type: ignore[no-untyped-def]
        coro.close()
        return self.verdicts.pop(0)


def test_reachability_asks_again_when_nobody_answered_and_says_it_in_plain_words() -> None:
    said: list[str] = []
    changes: list[str] = []
    nobody = Verdict(UNKNOWN, (), (4040,), asked=1)
    closed = Verdict(OUTBOUND_ONLY, (("p", False),), (4040,), asked=1)
    r = Reachability(_FakeDHT([nobody, closed]), said.append, lambda v: changes.append(v.mode))
    assert r.first_check(pause=0.0).mode == OUTBOUND_ONLY
    assert changes == [OUTBOUND_ONLY]
    assert said[0].startswith("reachability: behind NAT: joined as an outbound-only member") and "4040" in said[0]
    # a later check that nobody answers keeps what we knew
    r.dht = _FakeDHT([Verdict(UNKNOWN, (), (4040,), asked=2)])
    assert r.check().mode == OUTBOUND_ONLY and changes == [OUTBOUND_ONLY]


def test_the_first_peer_of_a_run_says_it_does_not_know_yet() -> None:
    said: list[str] = []
    r = Reachability(_FakeDHT([Verdict(UNKNOWN, (), (4040,), asked=0)]), said.append, lambda v: None)
    assert r.first_check(pause=0.0).mode == UNKNOWN
    assert said == ["reachability: not known yet (no peer to check with); acting as reachable, checking again as "
                    "peers join"]
    assert describe(Verdict(DIRECT, (("a", True), ("b", True)), (31337,), 2)) == (
        "reachability: reachable directly (2 of 2 peers could dial us at port 31337)")
