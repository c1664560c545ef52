"""Bench hosts in network namespaces: N peers on one bridge, each peer's upload capped with ``tc tbf``.

Layout (nothing is configured in the root namespace)::

    <tag>br           the "switch" namespace holding bridge br0
    <tag>p0..p{N-1}   one namespace per peer: eth0 = 10.80.<pid % 250>.(i+1)/24, lo up
    veth pairs        <tag>p<i>:eth0 <-> <tag>br:vp<i> (enslaved to br0)
    shaping           egress of <tag>p<i>:eth0 (the peer's upload) limited with tbf; ``shape`` changes it

``<tag>`` is ``hu<pid>``. ``down()`` kills whatever still runs inside the namespaces (the caller stops its
own processes first) and deletes them all; ``remove_stale()`` deletes the empty namespaces of an earlier
run whose process is gone (one that was SIGKILLed). netem is not used: only tbf exists on the machines
these benches run on.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess

PREFIX = "hu"


def parse_rate(text: str) -> float:
    """``100mbit`` -> bits per second (tc's units: kbit, mbit, gbit, or plain bit/s)."""
    t = text.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def _burst(rate: str, floor: int = 65536) -> int:
    """tbf bucket: 10 ms at the rate, at least ``floor`` bytes (64 KiB: enough for the kernel's timer
    granularity; bench.join keeps the 32 KiB its published numbers were measured with)."""
    return max(floor, int(parse_rate(rate) / 8 / 100))


class Netns:
    """N peer namespaces on one bridge; construct, ``up()``, and always ``down()`` (idempotent)."""

    def __init__(self, n: int):
        tag = os.getpid()
        self.bridge = f"{PREFIX}{tag}br"
        self.names = [f"{PREFIX}{tag}p{i}" for i in range(n)]
        self.addrs = [f"10.80.{tag % 250}.{i + 1}" for i in range(n)]
        self.rates: list[str | None] = [None] * n
        self.created: list[str] = []

    @staticmethod
    def available() -> str | None:
        """None if namespaces, veth pairs and tbf qdiscs can be made here, else why not."""
        probe = f"{PREFIX}{os.getpid()}probe"
        try:
            _sh("ip", "netns", "add", probe)
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            return f"cannot create network namespaces here ({e}; {err.decode(errors='replace').strip()})"
        try:
            _sh("ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "a1")
            _sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1mbit",
                "burst", "65536", "latency", "50ms")
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot create veth pairs or tbf qdiscs here ({e})"
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
        return None

    @staticmethod
    def remove_stale() -> list[str]:
        """Deletes namespaces of an earlier bench run whose process is gone and that hold no process."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        removed = []
        for name in (line.split()[0] for line in out.splitlines() if line.strip()):
            m = re.fullmatch(rf"{PREFIX}(\d+)(br|p\d+|probe)", name)
            if m is None or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10).stdout
            if not pids.split():
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
                removed.append(name)
        return removed

    def _add(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self.created.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def up(self) -> Netns:
        self._add(self.bridge)
        _sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            self._add(ns)
            _sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"vp{i}")
            _sh("ip", "-n", ns, "link", "set", f"vp{i}", "netns", self.bridge)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.bridge, "link", "set", f"vp{i}", "master", "br0")
            _sh("ip", "-n", self.bridge, "link", "set", f"vp{i}", "up")
        return self

    def shape(self, i: int, rate: str, burst_floor: int = 65536) -> None:
        """Caps peer i's upload at ``rate`` (tc units, e.g. ``100mbit``), replacing any earlier cap."""
        _sh("ip", "netns", "exec", self.names[i], "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", rate, "burst", str(_burst(rate, burst_floor)), "latency", "50ms")
        self.rates[i] = rate

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside peer i's namespace."""
        return ["ip", "netns", "exec", self.names[i]]

    def down(self) -> None:
        for ns in reversed(self.created):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
            for pid in out.stdout.split():  # the caller stopped its processes; nothing may outlive the net
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.created.clear()
