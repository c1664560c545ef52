"""Hosts behind NAT routers, in network namespaces (docs/REACH.md, "Topology"): bench.reach and the NAT tests.

One "public" segment (a bridge in its own namespace, ``<public>.0/24``) holds public hosts and the
public legs of NAT routers. Each router has a private LAN (``192.168.X.0/24``, a bridge inside the
router) with hosts behind it, and nftables ``masquerade`` on its public leg (``wan``); a symmetric
router uses ``masquerade random,fully-random`` (a new source port per destination). By default a
router also silently DROPS unsolicited inbound traffic, like a home router: REACH E6/E7 found that a
router that answers with RST (the Linux default) defeats hole punching, and one that drops does not.

Every name starts with a random tag (``nt`` + 4 chars), so parallel runs cannot clash. ``down()``
kills every process left in the namespaces and removes them all (their veths go with them); it is
idempotent and also cleans up after a build that failed half way.

The public segment defaults to 10.88.0.0/24, which is private (RFC 1918): hivetrain's Sybil prefix cap
exempts it, and go-libp2p's hole punching ignores such addresses (``manet.IsPublicAddr``). Pass a
public-looking ``public_net`` (REACH used ``23.77.0``) to test either of those; then all public hosts
and routers share one /24.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import string
import subprocess

from bench.netns import parse_rate

_ALPHABET = string.ascii_lowercase + string.digits


def _run(cmd: list[str], stdin: str | None = None) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10, input=stdin)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(cmd)} failed: {e.stderr.strip()}") from None


def _in(ns: str, *cmd: str, stdin: str | None = None) -> None:
    _run(["ip", "netns", "exec", ns, *cmd], stdin)


def _nat_rules(symmetric: bool, drop_inbound: bool) -> str:
    masq = "masquerade random,fully-random" if symmetric else "masquerade"
    rules = f"table ip nat {{\n  chain post {{ type nat hook postrouting priority srcnat; oifname \"wan\" {masq}; }}\n}}\n"
    if drop_inbound:
        for hook in ("input", "forward"):
            rules += (f"table ip fw_{hook} {{\n  chain c {{ type filter hook {hook} priority filter; policy accept;\n"
                      "    iifname \"wan\" ct state established,related accept;\n"
                      "    iifname \"wan\" drop; }\n}\n")
    return rules


class NatNet:
    def __init__(self, public_net: str = "10.88.0"):
        self.tag = "nt" + "".join(secrets.choice(_ALPHABET) for _ in range(4))
        self.public_net = public_net
        self.switch = f"{self.tag}-sw"
        self._namespaces: list[str] = []  # in creation order; down() removes them in reverse
        self._ips: dict[str, str] = {}  # ns -> its address on its own segment (public, or LAN if behind)
        self._lans: dict[str, int] = {}  # router ns -> X of its 192.168.X.0/24
        self._ports = 0  # switch-side veth names s0, s1, ...
        self._lan_hosts: dict[str, int] = {}  # router ns -> hosts behind it so far

    @staticmethod
    def available() -> str | None:
        """None if NAT namespaces can be built here, else a one-line reason to skip."""
        if os.geteuid() != 0:
            return "NAT namespaces need root"
        for tool in ("ip", "nft", "ss"):
            if shutil.which(tool) is None:
                return f"no `{tool}` command here"
        probe = f"ntprobe{os.getpid()}"
        try:
            _run(["ip", "netns", "add", probe])
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            return f"cannot create network namespaces here ({e})"
        try:
            _in(probe, "nft", "-f", "-", stdin=_nat_rules(symmetric=True, drop_inbound=True))
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            return f"nftables NAT does not work in a namespace here ({e})"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
        return None

    # --- building ------------------------------------------------------------------------------

    def _add_ns(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        assert ns not in self._namespaces, f"{name} exists already"
        self._namespaces.append(ns)  # before creating: down() must try to remove it even if this fails
        _run(["ip", "netns", "add", ns])
        _in(ns, "ip", "link", "set", "lo", "up")
        return ns

    def _on_switch(self, ns: str) -> str:
        """Plugs ``ns`` into the public segment as interface ``wan``; returns its public address."""
        if not self._ports:
            self._add_ns("sw")
            _in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _in(self.switch, "ip", "link", "set", "br0", "up")
        port = f"s{self._ports}"
        self._ports += 1
        ip = f"{self.public_net}.{self._ports}"
        assert self._ports < 255, "public segment full"
        _run(["ip", "link", "add", "wan", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch])
        _in(self.switch, "ip", "link", "set", port, "master", "br0", "up")
        _in(ns, "ip", "addr", "add", f"{ip}/24", "dev", "wan")
        _in(ns, "ip", "link", "set", "wan", "up")
        return ip

    def public(self, name: str) -> str:
        """A host on the public segment; returns its namespace."""
        ns = self._add_ns(name)
        self._ips[ns] = self._on_switch(ns)
        return ns

    def router(self, name: str, symmetric: bool = False, drop_inbound: bool = True) -> str:
        """A NAT router: public leg ``wan``, LAN bridge ``lan`` at 192.168.X.1/24. Returns its namespace."""
        ns = self._add_ns(name)
        self._ips[ns] = self._on_switch(ns)
        x = self._lans[ns] = len(self._lans) + 1
        self._lan_hosts[ns] = 0
        _in(ns, "ip", "link", "add", "lan", "type", "bridge")
        _in(ns, "ip", "addr", "add", f"192.168.{x}.1/24", "dev", "lan")
        _in(ns, "ip", "link", "set", "lan", "up")
        _in(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _in(ns, "nft", "-f", "-", stdin=_nat_rules(symmetric, drop_inbound))
        return ns

    def behind(self, router: str, name: str) -> str:
        """A host on ``router``'s LAN (192.168.X.2, .3, ...), default route via the router."""
        x = self._lans[router]
        self._lan_hosts[router] += 1
        i = self._lan_hosts[router]
        ns = self._add_ns(name)
        ip = self._ips[ns] = f"192.168.{x}.{i + 1}"
        _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"l{i}", "netns", router])
        _in(router, "ip", "link", "set", f"l{i}", "master", "lan", "up")
        _in(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        _in(ns, "ip", "link", "set", "eth0", "up")
        _in(ns, "ip", "route", "add", "default", "via", f"192.168.{x}.1")
        return ns

    def shape(self, ns: str, rate: str) -> None:
        """Caps the upload of a public host or a router (all its LAN hosts together) at ``rate`` (tc
        units, e.g. ``100mbit``) with a token bucket on its public leg."""
        burst = max(65536, int(parse_rate(rate) / 8 / 250))  # 4 ms of traffic, at least 64 KiB
        _in(ns, "tc", "qdisc", "replace", "dev", "wan", "root", "tbf", "rate", rate, "burst", str(burst),
            "latency", "50ms")

    # --- using ---------------------------------------------------------------------------------

    def ip_of(self, ns: str) -> str:
        """The public address of a public host or a router; the LAN address of a host behind a router."""
        return self._ips[ns]

    @staticmethod
    def exec_prefix(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def established(self, ns: str) -> set[tuple[str, str]]:
        """(local ip:port, remote ip:port) of the established TCP connections inside ``ns``."""
        out = subprocess.run([*self.exec_prefix(ns), "ss", "-tnH", "state", "established"],
                             check=True, capture_output=True, text=True, timeout=10).stdout
        conns = set()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 4:  # Recv-Q Send-Q Local Peer (no State column with a state filter)
                conns.add((fields[2], fields[3]))
        return conns

    def down(self) -> None:
        """Kills what runs in the namespaces and removes them; safe to call again or after a failed build."""
        for ns in reversed(self._namespaces):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._namespaces.clear()
