"""Test hosts in network namespaces: N peers on one bridge, and partitions by blackhole routes.

Every namespace and veth this creates is removed by ``down()``; processes started inside must be
stopped by the caller first. Addresses live only inside the namespaces (10.78.x.0/24).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class Net:
    def __init__(self, n: int):
        tag = os.getpid() % 100_000
        self.n, self.tag = n, tag
        self.bridge = f"ht{tag}br"
        self.peers = [f"ht{tag}p{i}" for i in range(n)]
        self.addrs = [f"10.78.{tag % 250}.{i + 1}" for i in range(n)]
        self._cuts: list[tuple[int, str]] = []

    @staticmethod
    def available() -> str | None:
        """None if namespaces can be made here, else the reason."""
        probe = f"htprobe{os.getpid()}"
        try:
            subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot create network namespaces here ({e})"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
        return None

    def up(self) -> Net:
        subprocess.run(["ip", "netns", "add", self.bridge], check=True, capture_output=True, timeout=10)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge)
        _ip("link", "set", "br0", "up", ns=self.bridge)
        for i, (ns, addr) in enumerate(zip(self.peers, self.addrs, strict=True)):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"vp{i}", "netns", self.bridge)
            _ip("link", "set", f"vp{i}", "master", "br0", ns=self.bridge)
            _ip("link", "set", f"vp{i}", "up", ns=self.bridge)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        return self

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.peers[i]]

    def partition(self, side_a: list[int], side_b: list[int]) -> None:
        """Silently drops all traffic between the two sides (no RST, no ICMP)."""
        for a in side_a:
            for b in side_b:
                for src, dst in ((a, b), (b, a)):
                    _ip("route", "add", "blackhole", f"{self.addrs[dst]}/32", ns=self.peers[src])
                    self._cuts.append((src, self.addrs[dst]))

    def heal(self) -> None:
        for src, dst in self._cuts:
            _ip("route", "del", "blackhole", f"{dst}/32", ns=self.peers[src])
        self._cuts.clear()

    def down(self) -> None:
        for ns in [*self.peers, self.bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def namespaces(n: int) -> Iterator[Net]:
    """``n`` peer namespaces on one bridge for a test (skipped with the reason where none can be
    made), removed afterwards."""
    reason = Net.available()
    if reason:
        pytest.skip(reason)
    network = Net(n).up()
    try:
        yield network
    finally:
        network.down()
