"""Network prefixes (peer/net/prefixes.py): prefix_of, cap_by_prefix; and the daemon's view of our
connections (peer/net/libp2p.py observed_addrs) against fake daemons."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multiaddr import Multiaddr

from hivetrain.peer.net import libp2p
from hivetrain.peer.net.libp2p import MAX_ADDRS_PER_PEER, observed_addrs
from hivetrain.peer.net.prefixes import cap_by_prefix, cap_key, first_prefix, prefix_of, relay_prefix

PID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PID2 = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

# ---- prefix_of ------------------------------------------------------------------------------------

PREFIX_CASES = [
    # public IPv4: its /24
    ("/ip4/203.0.113.7/tcp/4001", "203.0.113.0/24"),
    ("/ip4/203.0.113.255/tcp/1", "203.0.113.0/24"),
    ("/ip4/8.8.8.8/udp/4001/quic", "8.8.8.0/24"),
    (f"/ip4/198.51.100.9/tcp/31337/p2p/{PID}", "198.51.100.0/24"),
    ("/ip4/100.63.255.1/tcp/1", "100.63.255.0/24"),  # just below the CGNAT range
    ("/ip4/172.32.0.1/tcp/1", "172.32.0.0/24"),  # just above 172.16.0.0/12
    # public IPv6: its /48
    ("/ip6/2001:db8::1/udp/4001/quic", "2001:db8::/48"),
    ("/ip6/2001:db8:abcd:12:ffff::1/tcp/1", "2001:db8:abcd::/48"),
    (f"/ip6/2a00:1450:4001:82b::200e/tcp/443/p2p/{PID2}", "2a00:1450:4001::/48"),
    # an IPv4 host seen over IPv6 is still that IPv4 host
    ("/ip6/::ffff:203.0.113.7/tcp/1", "203.0.113.0/24"),
    ("/ip6/2002:cb00:7107::1/tcp/1", "203.0.113.0/24"),  # 6to4 of 203.0.113.7
    # exempt: loopback, private, shared (CGNAT), link-local, unspecified
    ("/ip4/127.0.0.1/tcp/1", None),
    (f"/ip4/127.0.0.1/tcp/1/p2p/{PID}", None),
    ("/ip4/127.8.9.10/tcp/1", None),
    ("/ip6/::1/tcp/1", None),
    ("/ip6/::ffff:127.0.0.1/tcp/1", None),
    ("/ip4/10.1.2.3/tcp/1", None),
    ("/ip4/172.16.0.1/tcp/1", None),
    ("/ip4/172.31.255.254/tcp/1", None),
    ("/ip4/192.168.1.20/tcp/1", None),
    ("/ip4/100.64.0.1/tcp/1", None),
    ("/ip6/fd12:3456:789a::1/tcp/1", None),
    ("/ip6/fc00::1/tcp/1", None),
    ("/ip4/169.254.10.1/tcp/1", None),
    ("/ip6/fe80::1/tcp/1", None),
    ("/ip4/0.0.0.0/tcp/0", None),
    ("/ip6/::/tcp/0", None),
    # non-IP and relayed: not the peer's own network
    ("/dns4/example.com/tcp/4001", None),
    ("/dns/example.com/tcp/4001", None),
    ("/unix/tmp/p2pd.sock", None),
    (f"/p2p/{PID}", None),
    (f"/ip4/203.0.113.7/tcp/4001/p2p/{PID}/p2p-circuit", None),
    (f"/ip4/203.0.113.7/tcp/4001/p2p/{PID}/p2p-circuit/p2p/{PID2}", None),
    (f"/ip6/2001:db8::1/tcp/4001/p2p/{PID}/p2p-circuit/p2p/{PID2}", None),
    # malformed: never raises
    ("", None),
    ("/", None),
    ("garbage", None),
    ("ip4/203.0.113.7/tcp/1", None),
    ("/ip4", None),
    ("/ip4/999.1.1.1/tcp/1", None),
    ("/ip4/203.0.113.7/tcp/notaport", None),
    ("/ip4/2001:db8::1/tcp/1", None),
    ("/ip6/203.0.113.7/tcp/1", None),
    ("/ip4/203.0.113.7/bogus/1", None),
    ("/ip6zone/eth0/ip6/fe80::1/tcp/1", None),
    ("/ip4/203.0.113.7/tcp/1" + "/tcp/1" * 300, None),  # over MAX_MADDR_CHARS
    ("/ip4/203.0.113.7\x00/tcp/1", None),
]


@pytest.mark.parametrize(("addr", "expected"), PREFIX_CASES)
def test_prefix_of(addr: str, expected: str | None) -> None:
    assert prefix_of(addr) == expected


@pytest.mark.parametrize(("addr", "expected"), [c for c in PREFIX_CASES if c[1] is not None][:6])
def test_prefix_of_takes_a_multiaddr_too(addr: str, expected: str) -> None:
    assert prefix_of(Multiaddr(addr)) == expected


@pytest.mark.parametrize("bad", [None, 5, b"/ip4/203.0.113.7/tcp/1", ["/ip4/203.0.113.7/tcp/1"], object()])
def test_prefix_of_wrong_types_are_none(bad: Any) -> None:
    assert prefix_of(bad) is None


@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_prefix_of_never_raises_on_text(text: str) -> None:
    result = prefix_of(text)
    assert result is None or "/" in result


@given(st.ip_addresses(v=4), st.integers(0, 65535))
@settings(max_examples=200, deadline=None)
def test_prefix_of_v4_contains_the_address(ip: Any, port: int) -> None:
    import ipaddress

    result = prefix_of(f"/ip4/{ip}/tcp/{port}")
    if result is not None:
        net = ipaddress.ip_network(result)
        assert net.prefixlen == 24 and ip in net
        assert not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


@given(st.ip_addresses(v=6))
@settings(max_examples=200, deadline=None)
def test_prefix_of_v6_is_a_48_or_the_embedded_v4(ip: Any) -> None:
    import ipaddress

    result = prefix_of(f"/ip6/{ip}/udp/1/quic")
    if result is not None:
        net = ipaddress.ip_network(result)
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            assert net.prefixlen == 24 and embedded in net
        else:
            assert net.prefixlen == 48 and ip in net


def test_first_prefix_skips_exempt_addresses() -> None:
    assert first_prefix(["/ip4/127.0.0.1/tcp/1", "garbage", "/ip4/203.0.113.7/tcp/1"]) == "203.0.113.0/24"
    assert first_prefix(["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.1/tcp/1"]) is None
    assert first_prefix([]) is None


def test_a_relayed_peer_counts_as_its_relays_prefix_apart_from_the_peers_seen_there_directly() -> None:
    relayed = f"/ip4/203.0.113.9/tcp/4001/p2p/{PID}/p2p-circuit"
    assert relay_prefix(relayed) == "relay:203.0.113.0/24" and prefix_of(relayed) is None
    assert relay_prefix("/ip4/203.0.113.9/tcp/4001") is None  # a direct address is no relay's
    assert relay_prefix(f"/ip4/10.1.2.3/tcp/4001/p2p/{PID}/p2p-circuit") is None  # a private relay: exempt
    assert relay_prefix("x" * 2000 + "/p2p-circuit") is None
    assert cap_key([relayed]) == "relay:203.0.113.0/24"
    assert cap_key([relayed, "/ip4/198.51.100.4/tcp/1"]) == "198.51.100.0/24"  # a direct address comes first
    assert cap_key(["/ip4/127.0.0.1/tcp/1", f"/ip4/10.1.2.3/tcp/4001/p2p/{PID}/p2p-circuit"]) is None
    # review N6: three identities relayed through one /24 against a cap of 2 per group
    members = ["me", "r1", "r2", "r3", "d1"]
    prefixes = {"r1": cap_key([relayed]), "r2": cap_key([relayed.replace(".9/", ".10/")]),
                "r3": cap_key([relayed.replace(".9/", ".11/")]), "d1": cap_key(["/ip4/203.0.113.50/tcp/1"])}
    kept, dropped = cap_by_prefix(members, prefixes, 2, _rank("r"))
    assert len(dropped) == 1 and set(dropped) < {"r1", "r2", "r3"} and "d1" in kept


# ---- cap_by_prefix --------------------------------------------------------------------------------


def _rank(salt: str) -> Any:
    return lambda peer: hashlib.sha256(f"{salt}|{peer}".encode()).digest()


def test_cap_keeps_the_lowest_ranked_per_prefix_in_input_order() -> None:
    members = ["a", "b", "c", "d", "e", "f"]
    prefixes = {"a": "P", "b": "P", "c": "P", "d": "Q", "e": None}  # f: unknown
    rank = {"a": b"\x03", "b": b"\x01", "c": b"\x02", "d": b"\x00", "e": b"\x00", "f": b"\x00"}
    kept, dropped = cap_by_prefix(members, prefixes, 2, rank.__getitem__)
    assert kept == ["b", "c", "d", "e", "f"]
    assert list(dropped) == ["a"] and "P" in dropped["a"] and "at most 2" in dropped["a"]


def test_cap_ties_break_by_peer_id() -> None:
    kept, dropped = cap_by_prefix(["z", "y", "x"], dict.fromkeys("xyz", "P"), 1, lambda p: b"")
    assert kept == ["x"] and set(dropped) == {"y", "z"}


@pytest.mark.parametrize("cap", [0, -1])
def test_cap_of_zero_or_less_disables(cap: int) -> None:
    members = ["a", "b", "c"]
    assert cap_by_prefix(members, dict.fromkeys(members, "P"), cap, lambda p: b"") == (members, {})


def test_exempt_and_unknown_prefixes_are_unlimited() -> None:
    members = [f"p{i}" for i in range(50)]
    prefixes: dict[str, str | None] = dict.fromkeys(members[:25])
    kept, dropped = cap_by_prefix(members, prefixes, 1, _rank("r"))
    assert kept == members and dropped == {}


def test_cap_rejects_duplicate_members() -> None:
    with pytest.raises(ValueError, match="distinct"):
        cap_by_prefix(["a", "a"], {}, 1, lambda p: b"")


def test_cap_choice_changes_with_the_round_salt() -> None:
    members = [f"p{i}" for i in range(8)]
    prefixes = dict.fromkeys(members, "P")
    chosen = {tuple(cap_by_prefix(members, prefixes, 1, _rank(f"round-{r}"))[0]) for r in range(40)}
    assert len(chosen) > 1  # no identity is the permanent winner of its prefix


@given(
    st.lists(st.tuples(st.text("abcdefgh", min_size=1, max_size=4), st.sampled_from(["P", "Q", "R", None])),
             max_size=30, unique_by=lambda t: t[0]),
    st.integers(-1, 5),
    st.text(max_size=8),
)
@settings(max_examples=200, deadline=None)
def test_cap_properties(pairs: list[tuple[str, str | None]], cap: int, salt: str) -> None:
    members = [m for m, _ in pairs]
    prefixes = dict(pairs)
    kept, dropped = cap_by_prefix(members, prefixes, cap, _rank(salt))
    # a partition of the input, kept in input order
    assert set(kept).isdisjoint(dropped) and set(kept) | set(dropped) == set(members)
    assert kept == [m for m in members if m in set(kept)]
    counts = Counter(prefixes[m] for m in kept)
    for prefix, n in Counter(prefixes[m] for m in members).items():
        if prefix is None or cap <= 0:
            assert counts[prefix] == n
        else:
            assert counts[prefix] == min(n, cap)
    # deterministic in the data, whatever the order members are listed in
    kept2, dropped2 = cap_by_prefix(list(reversed(members)), dict(reversed(pairs)), cap, _rank(salt))
    assert set(kept2) == set(kept) and dropped2 == dropped


# ---- observed_addrs against fake daemons -----------------------------------------------------------


async def observed_prefixes(p2p: Any, peers: list[str]) -> dict[str, str | None]:
    """What the averager's caps and a joiner's votes make of the addresses: the first prefix."""
    return {peer: first_prefix(addrs) for peer, addrs in (await observed_addrs(p2p, peers)).items()}


class _Id:
    def __init__(self, b58: str):
        self.b58 = b58

    def to_base58(self) -> str:
        return self.b58


class _Info:
    def __init__(self, peer: str, addrs: list[str]):
        self.peer_id, self.addrs = _Id(peer), [Multiaddr(a) for a in addrs]


class _FakeP2P:
    def __init__(self, infos: list[Any] | None = None, error: BaseException | None = None, hang: bool = False):
        self.infos, self.error, self.hang = infos or [], error, hang

    async def list_peers(self) -> list[Any]:
        if self.hang:
            await asyncio.sleep(3600)
        if self.error is not None:
            raise self.error
        return self.infos


def test_observed_groups_connections_by_peer() -> None:
    p2p = _FakeP2P([
        _Info("A", ["/ip4/127.0.0.1/tcp/5000"]),
        _Info("B", ["/ip4/203.0.113.7/tcp/4001"]),
        _Info("A", ["/ip4/198.51.100.3/tcp/6000"]),  # a second connection to A
        _Info("A", ["/ip4/127.0.0.1/tcp/5000"]),  # a duplicate
        _Info("C", ["/ip4/192.0.2.1/tcp/1"]),  # not asked about
    ])
    addrs = asyncio.run(observed_addrs(p2p, ["A", "B", "D"]))
    assert addrs == {"A": ["/ip4/127.0.0.1/tcp/5000", "/ip4/198.51.100.3/tcp/6000"],
                     "B": ["/ip4/203.0.113.7/tcp/4001"], "D": []}
    prefixes = asyncio.run(observed_prefixes(p2p, ["A", "B", "D"]))
    assert prefixes == {"A": "198.51.100.0/24", "B": "203.0.113.0/24", "D": None}


def test_observed_addresses_per_peer_are_bounded() -> None:
    p2p = _FakeP2P([_Info("A", [f"/ip4/203.0.113.{i}/tcp/1"]) for i in range(100)])
    assert len(asyncio.run(observed_addrs(p2p, ["A"]))["A"]) == MAX_ADDRS_PER_PEER


class _BadInfo:
    @property
    def peer_id(self) -> Any:
        raise ValueError("bad id")


def test_a_malformed_entry_costs_only_itself() -> None:
    p2p = _FakeP2P([_BadInfo(), _Info("A", ["/ip4/203.0.113.7/tcp/1"])])
    assert asyncio.run(observed_prefixes(p2p, ["A"])) == {"A": "203.0.113.0/24"}


@pytest.mark.parametrize("error", [ConnectionRefusedError("daemon gone"), ValueError("bad multiaddr bytes"),
                                   asyncio.IncompleteReadError(b"", 4), RuntimeError("control failure")])
def test_a_daemon_error_is_not_raised(error: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="hivetrain.peer.net.libp2p")
    assert asyncio.run(observed_prefixes(_FakeP2P(error=error), ["A", "B"])) == {"A": None, "B": None}
    assert "list_peers failed" in caplog.text


def test_a_hanging_daemon_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libp2p, "OBSERVE_TIMEOUT", 0.05)

    async def go() -> dict[str, list[str]]:
        return await asyncio.wait_for(observed_addrs(_FakeP2P(hang=True), ["A"]), timeout=5)

    assert asyncio.run(go()) == {"A": []}


def test_cancellation_propagates() -> None:
    async def go() -> None:
        task = asyncio.ensure_future(observed_addrs(_FakeP2P(hang=True), ["A"]))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(go())
