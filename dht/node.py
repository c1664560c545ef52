"""The one facade over hivemind's DHT. It owns the event loop that talks to hivemind.

``DHT`` starts a background thread running one asyncio loop, a p2pd daemon (hivemind ``P2P``)
and a ``DHTNode`` on top of it. Every public method is synchronous, called from the training
thread, and takes a deadline; the averaging layer runs its coroutines on the same loop through
``run`` / ``submit``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import clock, hardening, store_guard
from .diagnose import diagnose, parse_maddrs
from .errors import BootstrapError, DHTError, DHTTimeout, InvalidRecord
from .identity import Identity, public_key_of
from .process import children_die_with_us, remove_stale_sockets
from .quota import QuotaConfig
from .records import Envelope
from .validator import EnvelopeValidator

T = TypeVar("T")
REFRESH_PERIOD = 15.0  # seconds between attempts to re-contact peers that fell out of the routing table
MAX_KNOWN = 256
REAP_GRACE = 2.0  # seconds a daemon whose start failed gets to exit by itself before it is signalled (_reap)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DHTOptions:
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity: Identity | None = None  # the peer's key (libp2p id and record signer); None: a fresh one
    timeout: float = 15.0  # seconds: bootstrap and each DHT call
    store_quota: QuotaConfig = field(default_factory=QuotaConfig)  # caps on what other peers store here


class DHT:
    """A DHT node in a background event-loop thread. Methods are thread-safe and bounded in time."""

    def __init__(self, options: DHTOptions):
        self.options = options
        self._initial = parse_maddrs(options.initial_peers, "initial peer", need_peer_id=True)
        self._host = parse_maddrs(options.host_maddrs, "host address", need_peer_id=False)
        self._announce = parse_maddrs(options.announce_maddrs, "announce address", need_peer_id=False)
        self.identity = options.identity or Identity.generate()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="hivetrain-dht", daemon=True)
        self._node: Any = None
        self.p2p: Any = None
        self.peer_id: str = ""
        self._known: dict[str, None] = {}  # bound peer ids of this run, least recently noted first (bounded)
        self._refresher: asyncio.Task[None] | None = None

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.set_exception_handler(_quiet_dropped_streams)
        self.loop.run_forever()

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> DHT:
        """Starts p2pd and the DHT node, bootstrapping from the initial peers; raises BootstrapError."""
        self._thread.start()
        try:
            self.run(self._start(), timeout=self.options.timeout + 20)
        except DHTTimeout:
            self.shutdown()
            raise BootstrapError(
                f"could not join the DHT within {self.options.timeout + 20:.0f} s; check --initial-peers"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        return self

    async def _start(self) -> None:
        from hivemind.dht.node import DHTNode
        from hivemind.p2p import P2P
        from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

        hardening.install()  # before any peer can send us bytes
        store_guard.install()  # before DHTNode.create registers the rpc_store handler
        remove_stale_sockets()
        # p2pd reads its key from a file: a private one (0600) that lives only while the daemon starts
        key_dir = tempfile.mkdtemp(prefix="hivetrain-key-")
        started: list[Any] = []  # the p2pd process, once spawned
        key_path = os.path.join(key_dir, "p2p.key")
        try:
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.identity.p2p_private_key())
            with children_die_with_us(started):
                self.p2p = await P2P.create(
                    initial_peers=self._initial or None,
                    host_maddrs=self._host,
                    announce_maddrs=self._announce or None,
                    identity_path=key_path,
                    check_if_identity_free=False,  # hivemind's check assumes RSA keys; ours is Ed25519
                    nat_port_map=False,  # no UPnP by default: do not open ports on the user's router
                    startup_timeout=self.options.timeout,
                )
        except P2PDaemonError as e:
            await _reap(started)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if self._initial and "bootstrap" in msg:
                why = await asyncio.to_thread(diagnose, self._initial)
                raise BootstrapError(f"could not join through any initial peer: {why}") from None
            if self._initial:
                raise BootstrapError(f"could not reach any initial peer ({msg[:200]})") from None
            raise DHTError(f"could not start the p2p daemon: {msg[:200]}") from None
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)
        try:
            self._node = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=[str(m) for m in self._initial] or None,
                record_validator=EnvelopeValidator(),
                bootstrap_timeout=self.options.timeout,
                wait_timeout=min(3.0, self.options.timeout),  # one RPC: an unreachable node costs this much
                num_workers=4,
                cache_locally=False,
            )
        except RuntimeError as e:
            if "bootstrap failed" in str(e):
                why = await asyncio.to_thread(diagnose, self._initial)
                raise BootstrapError(f"none of the initial peers answered as a DHT node: {why}") from None
            raise
        store_guard.attach(self._node.protocol, self.options.store_quota)
        self.peer_id = self.p2p.peer_id.to_base58()
        if self.peer_id != self.identity.peer_id:  # p2pd must run with our key, or our signatures mean nothing
            raise DHTError(f"p2p daemon runs as {self.peer_id}, not as our identity {self.identity.peer_id}")
        self.remember(m["p2p"] for m in self._initial)
        self._refresher = asyncio.create_task(self._refresh_routing())

    def remember_threadsafe(self, peer_ids: Any) -> None:
        """``remember`` from another thread (the training thread); same contract."""
        self.loop.call_soon_threadsafe(self.remember, list(peer_ids))

    def remember(self, peer_ids: Any) -> None:
        """Notes peers of this run (loop thread); ``_refresh_routing`` re-contacts those we lost.

        Only bound identities may enter, or attackers choose whom we ping: pass the user's initial
        peers, ids from records that passed ``records.decode_bound`` (the signer's own libp2p id),
        or peers we completed rounds with. An id that embeds no Ed25519 key can sign no bound
        record and is ignored. The most recently noted are pinged first; at most MAX_KNOWN are kept."""
        for peer_id in peer_ids:
            if not peer_id or peer_id == self.peer_id:
                continue
            try:
                public_key_of(peer_id)
            except InvalidRecord:
                continue
            self._known.pop(peer_id, None)
            self._known[peer_id] = None
        while len(self._known) > MAX_KNOWN:
            self._known.pop(next(iter(self._known)))

    async def _refresh_routing(self) -> None:
        """Every REFRESH_PERIOD seconds, pings the most recent known peers of the run.

        After a partition heals, nobody would otherwise re-introduce the two sides' DHT nodes to
        each other and the run would stay split. Every known peer is pinged, not only those missing
        from our routing table: a peer whose own dials are still in libp2p's backoff (which grows
        quadratically with failed attempts) is reached through the connection we open to it."""
        from hivemind.p2p import PeerID

        while True:
            await asyncio.sleep(REFRESH_PERIOD)
            peers = []
            for p in list(self._known)[-32:]:
                try:
                    peers.append(PeerID.from_base58(p))
                except ValueError:  # a well-formed but undecodable id from someone's record: forget it
                    self._known.pop(p, None)
            await asyncio.gather(*(self._node.protocol.call_ping(p) for p in peers), return_exceptions=True)

    def shutdown(self) -> None:
        """Stops the DHT node, p2pd and the loop thread; safe to call twice."""
        if self.loop.is_running():
            async def _stop() -> None:
                if self._node is not None:
                    await self._node.shutdown()
                if self.p2p is not None:
                    await self.p2p.shutdown()
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.wait(others, timeout=2) if others else None

            try:
                self.run(_stop(), timeout=10)
            except Exception as e:  # shutting down: report, nothing else to restore
                logger.warning("DHT shutdown was not clean: %s", e)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()  # else its __del__ complains at exit, with a traceback a user would see

    @property
    def timeout(self) -> float:
        """Seconds one DHT operation may take (``DHTOptions.timeout``)."""
        return self.options.timeout

    # ---- calls from other threads ---------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs ``coro`` on the DHT loop and waits at most ``timeout`` seconds; raises DHTTimeout."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DHTTimeout(f"DHT operation timed out after {timeout:.1f} s") from None

    def quota_stats(self) -> dict[str, int]:
        """Counts of this node's store quota: requests, stored, stale, rejections by reason, entries."""
        async def _stats() -> dict[str, int]:
            return store_guard.guard_of(self._node.protocol).stats()

        return self.run(_stats(), timeout=self.options.timeout)

    def visible_maddrs(self) -> list[str]:
        maddrs = self.run(self.p2p.get_visible_maddrs(), timeout=self.options.timeout)
        return [str(m) for m in maddrs]

    # ---- records --------------------------------------------------------------------------------

    async def astore(self, envelope: Envelope) -> bool:
        return bool(await self._node.store(
            envelope.key, envelope.encode(), envelope.expiration, subkey=envelope.subkey
        ))

    async def aget(self, key: str, latest: bool = True) -> list[Envelope]:
        """All valid envelopes under ``key`` (one per signer), in no particular order."""
        found = await self._node.get(key, latest=latest)
        if found is None or not isinstance(found.value, dict):
            return []
        now = clock.wall()
        out = []
        for subkey, item in list(found.value.items())[:1024]:
            try:
                envelope = Envelope.decode(item.value, now=now)
            except InvalidRecord:
                continue  # a forged or broken record is ignored, the DHT validator should have stopped it
            if envelope.key == key and envelope.subkey == subkey and envelope.expiration >= now:
                out.append(envelope)
        return out

    def store(self, envelope: Envelope, timeout: float | None = None) -> bool:
        return self.run(self.astore(envelope), timeout or self.options.timeout)

    def get(self, key: str, latest: bool = True, timeout: float | None = None) -> list[Envelope]:
        return self.run(self.aget(key, latest), timeout or self.options.timeout)


async def _reap(processes: list[Any]) -> None:
    """Waits for daemons whose start failed, on the loop that spawned them: hivemind leaves a daemon
    that exited on a bootstrap failure unawaited, and once the loop is closed asyncio's child watcher
    prints "Loop ... that handles pid ... is closed" into the user's output.

    A daemon that failed to bootstrap exits by itself: it gets ``REAP_GRACE`` seconds before it is
    signalled, and then by ``os.kill``, not ``Process.terminate``: that polls the pid first
    (``Popen.send_signal``), and a poll that reaps an exited daemon before asyncio's watcher thread
    does makes the watcher print "Unknown child process pid ..." into the user's output."""
    for process in processes:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), REAP_GRACE)
        if process.returncode is None:  # still running after the grace: stop it
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 5)


def _quiet_dropped_streams(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The DHT loop's exception handler: a stream that p2pd closed before handing it over reaches
    hivemind's handler as an IncompleteReadError in ``client_connected_cb`` and would print a
    traceback into the user's log; the requester sees a failed request and retries. Logged at debug
    level; everything else goes to asyncio's default handler."""
    if isinstance(context.get("exception"), asyncio.IncompleteReadError) and "client_connected_cb" in str(
            context.get("message", "")):
        logger.debug("p2pd dropped an incoming stream before handing it over")
        return
    loop.default_exception_handler(context)
