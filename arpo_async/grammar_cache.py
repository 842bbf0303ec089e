"""The grammar backend's bookkeeping (arpo_async.grammar): which compiled grammars are kept, and in which order
queued compiles run. Pure and thread-agnostic: the caller holds one lock around every call (the backend does).

Role (issue 48 item 3): a client that asks for many distinct grammars must neither evict the run's own grammar
nor keep it waiting behind an unbounded queue of compiles.

- `PinnedCache`: compiled grammars in two tiers. A grammar that ``pin_after`` requests have used is *pinned*:
  kept for the life of the process, outside the least-recently-used tier, so no number of other grammars evicts
  it. At most ``pinned_max`` are pinned; when that many are, a grammar used by more requests than the least used
  pinned one takes its place (that one goes back to the least-recently-used tier). The run's action grammar is
  asked for by every step of every episode, so it is pinned after its first few steps and stays pinned.
- `CompileQueue`: one FIFO queue per client, served round-robin (the order trio's and Sample Factory's fair
  schedulers use), with at most ``per_client`` compiles queued or running per client. A client's new grammar
  therefore waits behind at most one compile of each other client, however many grammars one client sends; a
  request for a grammar already queued joins that compile and takes no place.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PinnedCache(Generic[K, V]):
    """Values by key: a pinned tier (never evicted) and a least-recently-used tier of ``size`` entries.

    Args:
        size: entries of the least-recently-used tier (the oldest is dropped when a new one would exceed it).
        pinned_max: most pinned entries.
        pin_after: requests (``get`` hits plus the ``uses`` given to ``put``) after which an entry is pinned.
    Raises:
        ValueError: a size, pinned_max or pin_after below 1.
    """

    def __init__(self, size: int, pinned_max: int, pin_after: int):
        if min(size, pinned_max, pin_after) < 1:
            raise ValueError(f"size, pinned_max and pin_after must be >= 1, got {size}, {pinned_max}, {pin_after}")
        self.size, self.pinned_max, self.pin_after = size, pinned_max, pin_after
        self._lru: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._pinned: dict[K, V] = {}
        self._uses: dict[K, int] = {}
        """Requests per key, for keys held in either tier only (dropped with the entry)."""

    def __contains__(self, key: K) -> bool:
        return key in self._pinned or key in self._lru

    def __len__(self) -> int:
        return len(self._pinned) + len(self._lru)

    @property
    def pinned(self) -> frozenset[K]:
        """The keys pinned now."""
        return frozenset(self._pinned)

    def get(self, key: K) -> V | None:
        """The value of ``key`` (None when not held); a hit counts one use and may pin the entry."""
        if key in self._pinned:
            self._uses[key] += 1
            return self._pinned[key]
        value = self._lru.get(key)
        if value is not None:
            self._lru.move_to_end(key)
            self._uses[key] += 1
            self._maybe_pin(key)
        return value

    def put(self, key: K, value: V, uses: int = 0) -> None:
        """Hold ``value`` (just compiled) as the most recently used, counting ``uses`` requests for it now."""
        if key in self._pinned:
            self._pinned[key] = value
            return
        self._lru[key] = value
        self._lru.move_to_end(key)
        self._uses[key] = self._uses.get(key, 0) + uses
        if not self._maybe_pin(key):
            self._trim()

    def _maybe_pin(self, key: K) -> bool:
        """Pin ``key`` (in the LRU tier) when it has ``pin_after`` uses and there is room, or when it has more uses
        than the least used pinned key (which goes back to the LRU tier as most recent). True when pinned."""
        uses = self._uses[key]
        if uses < self.pin_after:
            return False
        if len(self._pinned) >= self.pinned_max:
            weakest = min(self._pinned, key=self._uses.__getitem__)
            if self._uses[weakest] >= uses:
                return False
            self._lru[weakest] = self._pinned.pop(weakest)
        self._pinned[key] = self._lru.pop(key)
        self._trim()
        return True

    def _trim(self) -> None:
        while len(self._lru) > self.size:
            dropped, _ = self._lru.popitem(last=False)
            del self._uses[dropped]


class CompileQueue(Generic[K]):
    """Pending compiles: per-client FIFO queues served round-robin, at most ``per_client`` per client.

    A compile counts against the client that first asked for it from ``submit`` until ``done``; later requests
    for the same key (from any client) join its future for free.

    Args:
        per_client: most compiles one client may have queued or running at once.
    Raises:
        ValueError: per_client below 1.
    """

    def __init__(self, per_client: int):
        if per_client < 1:
            raise ValueError(f"per_client must be >= 1, got {per_client}")
        self.per_client = per_client
        self._futures: dict[K, concurrent.futures.Future] = {}
        self._owner: dict[K, str] = {}
        self._waiters: dict[K, int] = {}
        self._queues: collections.OrderedDict[str, collections.deque[K]] = collections.OrderedDict()
        self._held: collections.Counter[str] = collections.Counter()

    def held(self, client: str) -> int:
        """Compiles ``client`` has queued or running now."""
        return self._held[client]

    @property
    def pending(self) -> int:
        """Compiles queued or running."""
        return len(self._futures)

    def __len__(self) -> int:
        """Compiles queued (not yet taken by ``next_job``)."""
        return sum(len(q) for q in self._queues.values())

    def submit(self, key: K, client: str) -> concurrent.futures.Future | None:
        """The future of ``key``'s compile: the pending one, or a new one queued for ``client``; None when ``key``
        is not pending and ``client`` already holds ``per_client`` compiles (the caller refuses the request)."""
        future = self._futures.get(key)
        if future is not None:
            self._waiters[key] += 1
            return future
        if self._held[client] >= self.per_client:
            return None
        future = self._futures[key] = concurrent.futures.Future()
        self._owner[key], self._waiters[key] = client, 1
        self._held[client] += 1
        self._queues.setdefault(client, collections.deque()).append(key)
        return future

    def next_job(self) -> tuple[K, concurrent.futures.Future] | None:
        """The next compile to run: the oldest queued key of the client that was served longest ago (that client
        then goes to the back of the turn); None when nothing is queued."""
        if not self._queues:
            return None
        client, queue = next(iter(self._queues.items()))
        key = queue.popleft()
        del self._queues[client]
        if queue:
            self._queues[client] = queue  # back of the turn
        return key, self._futures[key]

    def done(self, key: K) -> int:
        """Forget ``key``'s compile (taken by ``next_job``, now settled); returns the requests that asked for it."""
        self._futures.pop(key, None)
        client = self._owner.pop(key)
        self._held[client] -= 1
        if not self._held[client]:
            del self._held[client]
        return self._waiters.pop(key)
