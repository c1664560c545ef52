"""Per-source DHT store quotas: the pure bookkeeping (no hivemind, no sockets, clock passed in).

A *source* is the libp2p peer id that sent a store request (authenticated by the secure channel,
so it cannot be spoofed, only multiplied). An *entry* is one stored (storage, key, subkey) slot.
``dht/store_guard.py`` applies these rules in front of hivemind's ``DHTProtocol.rpc_store``.

Which entry goes when storage is full: never simply the earliest-expiring one (hivemind's
``TimedStorage(maxsize)`` rule). Every record may claim up to ``MAX_TTL`` ahead, so an attacker
would always outlast honest records that are refreshed often with short lifetimes. Instead the
*largest holder* loses: the source that holds the most entries in the full scope (a key's
dictionary, or the whole storage) gives up its earliest-expiring entry; on a tie the source
that is storing right now loses (first come, first kept), then the one claiming the latest
expiration. One identity therefore can never push out a source holding fewer entries than itself;
crowding out honest records takes many identities.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, fields

WINDOW = 60.0  # seconds: the sliding window of the per-source request quota
MAX_REQUESTS_PER_WINDOW = 600  # store requests per source per window: an honest peer sends a few per round
MAX_VALUES_PER_WINDOW = 2048  # values per source per window: room for one full replication hand-over
MAX_VALUES_PER_REQUEST = 256  # hivemind hands all keys a new neighbour should hold in one request
MAX_SUBKEYS_PER_KEY = 256  # one record per peer under a run's key: a group never needs more
MAX_ENTRIES = 4096  # entries held for remote sources: worst case 4096 x 16 KiB = 64 MiB of records
MAX_TRACKED_SOURCES = 4096  # sources whose windows and log state we remember (least recent forgotten)
LOG_INTERVAL = 60.0  # seconds: at most one rejection log line per source per interval
MAX_LOG_LINES = 20  # rejection lines per interval over all sources: many identities cannot flood the log

REASONS = ("malformed", "too_many_values", "rate", "subkey_cap", "storage_cap")

Source = Hashable
EntryId = tuple[Hashable, Hashable, Hashable]  # (scope, key, subkey); its group is (scope, key)
Holdings = Mapping[Source, Mapping[EntryId, float]]  # source -> {entry: expiration}


@dataclass(frozen=True)
class QuotaConfig:
    """The caps one DHT node applies to stores from remote peers (defaults: the constants above)."""

    window: float = WINDOW
    max_requests_per_window: int = MAX_REQUESTS_PER_WINDOW
    max_values_per_window: int = MAX_VALUES_PER_WINDOW
    max_values_per_request: int = MAX_VALUES_PER_REQUEST
    max_subkeys_per_key: int = MAX_SUBKEYS_PER_KEY
    max_entries: int = MAX_ENTRIES

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window) and 0 < self.window <= 3600):
            raise ValueError(f"window must be in (0, 3600] seconds, got {self.window}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "window" and not (isinstance(value, int) and 1 <= value <= 10**6):
                raise ValueError(f"{f.name} must be an integer in [1, 1000000], got {value!r}")


class RateWindow:
    """Per-source counts of admitted store requests and values over a sliding window.

    The window is kept in ``SLICES`` slices, so a source costs at most that many small lists however
    fast it sends (a per-request timestamp would cost ``max_requests_per_window`` of them)."""

    SLICES = 12

    def __init__(self, max_sources: int = MAX_TRACKED_SOURCES):
        self.max_sources = max_sources
        self._windows: OrderedDict[Source, deque[list[int]]] = OrderedDict()  # [slice, requests, values]

    def admit(self, source: Source, values: int, now: float, config: QuotaConfig) -> bool:
        """Counts one request of ``values`` values if ``source`` is within its quota; else False.

        Refused requests are not counted: a source gets exactly its quota per window. The window is
        the current slice and the ``SLICES - 1`` before it (``window / SLICES`` seconds each)."""
        slices = self._windows.pop(source, None) or deque()
        self._windows[source] = slices  # most recent last
        while len(self._windows) > self.max_sources:
            self._windows.popitem(last=False)
        current = math.floor(now * self.SLICES / config.window)
        while slices and slices[0][0] <= current - self.SLICES:
            slices.popleft()
        requests = sum(s[1] for s in slices)
        total = sum(s[2] for s in slices)
        if requests >= config.max_requests_per_window or total + values > config.max_values_per_window:
            return False
        if not slices or slices[-1][0] != current:
            slices.append([current, 0, 0])
        slices[-1][1] += 1
        slices[-1][2] += values
        return True


def victims(holdings: Holdings, incoming: Source, count: int) -> list[EntryId]:
    """The ``count`` entries to evict from a full scope, one at a time from the largest holder.

    Each time, the source holding the most entries gives up its earliest-expiring one. On equal
    holdings ``incoming`` (the source storing now) loses first, then the source whose entries claim
    the latest expiration: long lifetimes do not win ties. Fewer than ``count`` if the holdings run
    out. O(entries + count log sources)."""
    order = itertools.count()
    heap = [(-len(entries), source != incoming, -max(entries.values()), next(order), source)
            for source, entries in holdings.items() if entries]
    heapq.heapify(heap)
    queues: dict[Source, list[tuple[float, int, EntryId]]] = {}
    out: list[EntryId] = []
    while heap and len(out) < count:
        held, not_incoming, latest, _, source = heapq.heappop(heap)
        if source not in queues:  # sorted latest first, so pop() gives the earliest
            queues[source] = sorted(((exp, next(order), e) for e, exp in holdings[source].items()), reverse=True)
        queue = queues[source]
        out.append(queue.pop()[2])
        if queue:  # its latest expiration is unchanged
            heapq.heappush(heap, (held + 1, not_incoming, latest, next(order), source))
    return out


def shrink(holdings: Callable[[], Holdings], size: Callable[[], int], cap: int, incoming: Source,
           evict: Callable[[EntryId], None]) -> None:
    """Evicts ``victims`` until ``size()`` fits ``cap``. ``evict`` must take each victim out of the
    ledger behind ``holdings`` (so the loop ends); it stops early when nothing is left to evict."""
    while (excess := size() - cap) > 0:
        chosen = victims(holdings(), incoming, excess)
        if not chosen:
            return  # only entries that no source holds (ours) are left
        for victim in chosen:
            evict(victim)


class Ledger:
    """Which source stored each live entry, indexed by source and by (scope, key) group."""

    def __init__(self) -> None:
        self._entries: dict[EntryId, tuple[Source, float]] = {}
        self._by_source: dict[Source, dict[EntryId, float]] = {}
        self._by_group: dict[Hashable, dict[Source, dict[EntryId, float]]] = {}
        self._heap: list[tuple[float, int, EntryId]] = []  # (expiration, tie-breaker, entry)
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: EntryId) -> bool:
        return entry in self._entries

    def get(self, entry: EntryId) -> tuple[Source, float] | None:
        return self._entries.get(entry)

    def record(self, entry: EntryId, source: Source, expiration: float) -> None:
        """Attributes ``entry`` (newly stored or overwritten) to ``source`` until ``expiration``."""
        self.forget(entry)
        self._entries[entry] = (source, expiration)
        self._by_source.setdefault(source, {})[entry] = expiration
        self._by_group.setdefault(entry[:2], {}).setdefault(source, {})[entry] = expiration
        self._pushes += 1
        heapq.heappush(self._heap, (expiration, self._pushes, entry))
        if len(self._heap) > 2 * len(self._entries) + 64:  # drop the leftovers of overwritten entries
            self._heap = [(exp, i, e) for exp, i, e in self._heap if self._entries.get(e, (None, None))[1] == exp]
            heapq.heapify(self._heap)

    def forget(self, entry: EntryId) -> None:
        found = self._entries.pop(entry, None)
        if found is None:
            return
        source = found[0]
        group = entry[:2]
        del self._by_source[source][entry]
        if not self._by_source[source]:
            del self._by_source[source]
        owners = self._by_group[group]
        del owners[source][entry]
        if not owners[source]:
            del owners[source]
        if not owners:
            del self._by_group[group]

    def prune(self, now: float) -> None:
        """Forgets entries that expired before ``now`` (hivemind drops them from storage too)."""
        while self._heap and self._heap[0][0] < now:
            expiration, _, entry = heapq.heappop(self._heap)
            found = self._entries.get(entry)
            if found is not None and found[1] == expiration:
                self.forget(entry)

    def by_source(self) -> Holdings:
        return self._by_source

    def in_group(self, group: Hashable) -> Holdings:
        return self._by_group.get(group, {})


class RejectionLog:
    """Counts rejections and says when one may be logged: at most once per source per interval,
    and at most ``max_lines`` lines per interval in all (counts wait for the source's next line)."""

    def __init__(self, interval: float = LOG_INTERVAL, max_lines: int = MAX_LOG_LINES,
                 max_sources: int = MAX_TRACKED_SOURCES):
        self.interval, self.max_lines, self.max_sources = interval, max_lines, max_sources
        self.totals: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._pending: OrderedDict[Source, tuple[float, dict[str, int]]] = OrderedDict()
        self._lines: deque[float] = deque()  # when the recent lines were logged

    def note(self, source: Source, reason: str, count: int, now: float) -> dict[str, int] | None:
        """Adds ``count`` rejections; returns the counts to log now (since the last line), or None."""
        assert reason in self.totals, reason
        self.totals[reason] += count
        last, counts = self._pending.pop(source, (-math.inf, {}))
        counts[reason] = counts.get(reason, 0) + count
        while self._lines and self._lines[0] <= now - self.interval:
            self._lines.popleft()
        if now - last >= self.interval and len(self._lines) < self.max_lines:
            self._lines.append(now)
            self._pending[source] = (now, {})
            out: dict[str, int] | None = counts
        else:
            self._pending[source] = (last, counts)
            out = None
        while len(self._pending) > self.max_sources:
            self._pending.popitem(last=False)
        return out
