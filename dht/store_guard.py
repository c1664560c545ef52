"""Per-source store quotas in front of hivemind's DHT store handler (rules in ``dht/quota.py``).

What is hooked: ``hivemind.dht.protocol.DHTProtocol.rpc_store`` (hivemind 1.1.12), the only RPC
through which a remote peer writes into a node's ``storage`` and ``cache`` (``DHTLocalStorage``,
``hivemind/dht/storage.py``). It is replaced on the class, before any protocol exists, because
``ServicerBase.add_p2p_handlers`` (called by ``DHTProtocol.create``) binds ``getattr(protocol,
"rpc_store")`` once; patching an instance afterwards would go unseen. The replacement does not
re-implement storing: it expands the request into (key, subkey) items, refuses what is over quota,
hands the rest to the original method as a smaller ``StoreRequest`` (so hivemind still validates
with our ``EnvelopeValidator`` and stores), then attributes what was stored to the sender
(``P2PContext.remote_id``, authenticated by libp2p) and trims the scopes that went over a cap.

Three hivemind behaviours this also covers:
- a whole-dictionary item (subkey tag ``b""``) carries any number of subkeys; it is expanded so
  every subkey counts against the quotas;
- ``TimedStorage.store`` re-points its expiration heap at an *older* copy before refusing it, so
  replaying a still-valid older envelope deletes the newer record at the older expiration. Items
  not newer than what is held are therefore dropped here, before hivemind sees them;
- a NaN expiration passes every ``<`` check in ``TimedStorage``: such a record would never expire
  and, at the root of the expiration heap, would stop everything else from expiring. Non-finite
  expirations make the whole request malformed (``validator.py`` refuses them as well).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from . import clock, hardening
from .quota import EntryId, Ledger, QuotaConfig, RateWindow, RejectionLog, Source, shrink

logger = logging.getLogger(__name__)
_REGULAR = object()  # the subkey slot of a plain (non-dictionary) value
_ATTR = "_hivetrain_store_guard"
KEY_BYTES = 20  # DHTID.HASH_NBYTES: anything else is not a key this DHT produces

Original = Callable[[Any, Any, Any], Awaitable[Any]]


@dataclass
class _Item:
    index: int  # position of the key in the request (a dictionary yields several items)
    key_id: Any  # DHTID
    tag: bytes  # serialized subkey as hivemind's rpc_store expects it
    subkey: Any  # the subkey itself, or _REGULAR
    value: bytes
    expiration: float
    in_cache: bool

    @property
    def scope(self) -> str:
        return "cache" if self.in_cache else "storage"

    @property
    def entry(self) -> EntryId:
        return (self.scope, self.key_id, self.subkey)


def install() -> None:
    """Idempotently wraps ``DHTProtocol.rpc_store``; call before any ``DHTNode.create``."""
    from hivemind.dht.protocol import DHTProtocol

    hardening.install()  # we decode dictionary values ourselves
    if getattr(DHTProtocol, "_hivetrain_quota", False):
        return
    original = DHTProtocol.rpc_store

    @functools.wraps(original)  # keeps the annotations ServicerBase reads to register the handler
    async def rpc_store(self: Any, request: Any, context: Any) -> Any:
        return await guard_of(self).handle(self, request, context, original)

    DHTProtocol.rpc_store = rpc_store  # type: ignore[method-assign]
    DHTProtocol._hivetrain_quota = True  # type: ignore[attr-defined]


def guard_of(protocol: Any) -> StoreGuard:
    """The guard of one DHTProtocol, created with the default caps on first use."""
    guard = protocol.__dict__.get(_ATTR)
    if guard is None:
        guard = StoreGuard(QuotaConfig())
        setattr(protocol, _ATTR, guard)
    return guard


def attach(protocol: Any, config: QuotaConfig) -> StoreGuard:
    """Sets the caps of ``protocol``'s guard, keeping what it already counted."""
    guard = guard_of(protocol)
    guard.config = config
    return guard


class StoreGuard:
    """Quota state of one DHT node. Runs on the node's event loop only (no locks needed)."""

    def __init__(self, config: QuotaConfig):
        self.config = config
        self.rates = RateWindow()
        self.ledger = Ledger()
        self.rejections = RejectionLog()
        self.counts = {"requests": 0, "stored": 0, "stale": 0, "evicted_others": 0}

    def stats(self) -> dict[str, int]:
        return {**self.counts, **self.rejections.totals, "entries": len(self.ledger)}

    async def handle(self, protocol: Any, request: Any, context: Any, original: Original) -> Any:
        """Serves one ``StoreRequest`` from ``context.remote_id`` on the protocol's event loop.

        Returns a ``StoreResponse`` with one flag per key of ``request``, as hivemind's does: False
        for a key if any of its values was refused, not newer, invalid or evicted right away."""
        from hivemind.proto import dht_pb2

        now = clock.wall()  # hivemind's get_dht_time
        source = context.remote_id.to_base58()
        self.counts["requests"] += 1
        self.ledger.prune(now)
        n = len(request.keys)
        refused = dht_pb2.StoreResponse(store_ok=[False] * n, peer=protocol.node_info)
        if n > self.config.max_values_per_request:
            self._reject(source, "too_many_values", n, now)
            return refused
        items = _expand(protocol, request)
        if items is None:
            self._reject(source, "malformed", max(n, 1), now)
            return refused
        if len(items) > self.config.max_values_per_request:
            self._reject(source, "too_many_values", len(items), now)
            return refused
        if not self.rates.admit(source, len(items), now, self.config):
            self._reject(source, "rate", len(items), now)
            return refused

        newest: dict[EntryId, _Item] = {}  # per slot, only a copy newer than the held one and the others
        for item in items:
            held = _held(protocol, item)
            rival = newest.get(item.entry)
            if (held is None or held.expiration_time < item.expiration) and (
                    rival is None or rival.expiration < item.expiration):
                newest[item.entry] = item
        fresh = list(newest.values())
        self.counts["stale"] += len(items) - len(fresh)  # duplicates, replays: hivemind would refuse them
        response = await original(protocol, dht_pb2.StoreRequest(
            keys=[item.key_id.to_bytes() for item in fresh], subkeys=[item.tag for item in fresh],
            values=[item.value for item in fresh], expiration_time=[item.expiration for item in fresh],
            in_cache=[item.in_cache for item in fresh], peer=request.peer,
        ), context)
        stored = []
        for item, ok in zip(fresh, response.store_ok, strict=True):
            held = _held(protocol, item)
            if ok and held is not None and (held.value, held.expiration_time) == (item.value, item.expiration):
                self.ledger.record(item.entry, source, item.expiration)
                stored.append(item)
        evicted = self._trim(protocol, source, {item.entry[:2] for item in stored}, now)
        kept = {id(item) for item in stored if item.entry not in evicted}
        self.counts["stored"] += len(kept)
        ok_by_index = [True] * n
        for item in items:
            ok_by_index[item.index] &= id(item) in kept
        return dht_pb2.StoreResponse(store_ok=ok_by_index, peer=protocol.node_info)

    def _trim(self, protocol: Any, source: Source, groups: set[Any], now: float) -> set[EntryId]:
        """Evicts the largest holders' entries until every touched key and the total fit the caps."""
        evicted: set[EntryId] = set()

        def evict(victim: EntryId, reason: str) -> None:
            owner = self.ledger.get(victim)
            self.ledger.forget(victim)
            if owner is None or not _delete(protocol, victim, owner[1]):
                return  # no longer what was recorded (e.g. overwritten by our own store): just forget it
            evicted.add(victim)
            if owner[0] == source:
                self._reject(source, reason, 1, now)
            else:
                self.counts["evicted_others"] += 1
                logger.debug("DHT store quota: evicted an entry of peer %s for peer %s", owner[0], source)

        for group in groups:
            shrink(functools.partial(self.ledger.in_group, group), functools.partial(_group_size, protocol, group),
                   self.config.max_subkeys_per_key, source, functools.partial(evict, reason="subkey_cap"))
        shrink(self.ledger.by_source, lambda: len(self.ledger), self.config.max_entries, source,
               functools.partial(evict, reason="storage_cap"))
        return evicted

    def _reject(self, source: Source, reason: str, count: int, now: float) -> None:
        counts = self.rejections.note(source, reason, count, now)
        if counts is not None:
            logger.warning(
                "DHT store quota: refused values from peer %s (%s); at most one such line per peer every %.0f s",
                source, ", ".join(f"{k}={v}" for k, v in sorted(counts.items())), self.rejections.interval,
            )


# ---- hivemind storage access ----------------------------------------------------------------------


def _storage(protocol: Any, scope: Any) -> Any:
    return protocol.cache if scope == "cache" else protocol.storage


def _expand(protocol: Any, request: Any) -> list[_Item] | None:
    """One item per (key, subkey) in ``request``; None if anything is malformed."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue

    columns = (request.keys, request.subkeys, request.values, request.expiration_time, request.in_cache)
    if len({len(c) for c in columns}) != 1:
        return None
    out = []
    serializer = protocol.serializer
    for index, (key, tag, value, expiration, in_cache) in enumerate(zip(*columns, strict=True)):
        if len(key) != KEY_BYTES or not math.isfinite(expiration):
            return None
        key_id = DHTID.from_bytes(key)
        if tag == protocol.IS_REGULAR_VALUE:
            out.append(_Item(index, key_id, tag, _REGULAR, value, expiration, in_cache))
            continue
        try:  # hostile bytes: msgpack raises many types; hardening caps ext nesting
            if tag == protocol.IS_DICTIONARY:
                dictionary = serializer.loads(value)
                if not isinstance(dictionary, DictionaryDHTValue):
                    return None
                with dictionary.freeze():
                    parts = [(serializer.dumps(s), s, v, e) for s, (v, e) in dictionary.items()]
            else:
                parts = [(tag, serializer.loads(tag), value, expiration)]
            for part_tag, subkey, part_value, part_expiration in parts:
                hash(subkey)  # hivemind keeps subkeys in a dict
                part_expiration = float(part_expiration)
                if part_tag == protocol.IS_REGULAR_VALUE or not isinstance(part_value, bytes) \
                        or not math.isfinite(part_expiration):
                    return None
                out.append(_Item(index, key_id, part_tag, subkey, part_value, part_expiration, in_cache))
        except Exception:
            return None
    return out


def _held(protocol: Any, item: _Item) -> Any:
    """What the node holds in ``item``'s slot: a ValueWithExpiration, or None."""
    from hivemind.dht.storage import DictionaryDHTValue

    found = _storage(protocol, item.scope).get(item.key_id)
    if found is None or item.subkey is _REGULAR:
        return found
    return found.value.get(item.subkey) if isinstance(found.value, DictionaryDHTValue) else None


def _group_size(protocol: Any, group: Any) -> int:
    from hivemind.dht.storage import DictionaryDHTValue

    found = _storage(protocol, group[0]).get(group[1])
    return len(found.value) if found is not None and isinstance(found.value, DictionaryDHTValue) else 0


def _delete(protocol: Any, entry: EntryId, expiration: float) -> bool:
    """Deletes ``entry`` if it still holds the copy that expires at ``expiration``."""
    from hivemind.dht.storage import DictionaryDHTValue

    scope, key_id, subkey = entry
    storage = _storage(protocol, scope)
    found = storage.get(key_id)
    if found is None:
        return False
    if subkey is _REGULAR:
        if found.expiration_time != expiration:
            return False
        del storage[key_id]
        return True
    if not isinstance(found.value, DictionaryDHTValue):
        return False
    held = found.value.get(subkey)
    if held is None or held.expiration_time != expiration:
        return False
    del found.value[subkey]
    if not found.value:
        del storage[key_id]
    return True
