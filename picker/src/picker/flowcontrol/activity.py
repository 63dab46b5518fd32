"""Who sent requests lately: the arrivals of the last `window` seconds per priority and client.

The controller asks it whether a request must leave room for others (room.py, holdback):
- a higher priority band had arrivals in the window (its next request should find a free slot);
- or the request's client sent more than its share of its band's arrivals in the window
  (share = 1 / clients seen in the band), so a light client next to a heavy one finds a slot.
The controller keeps a client's reserve only while the pool is saturated (controller.py): a
client that merely sends more requests, in a pool with room, is not held; a lower band gives way
to a higher one at any load. Arrivals are counted in requests: what a request will cost (its
answer's length) is unknown when it arrives.
A single client of a single band never holds back: without competition nothing changes. It is
also the one case where sending a request to an engine's queue at its age bound costs nobody
their order (`alone`): the engine's FIFO serves it as the picker's queue would.

With several worker processes (workers.py) each worker also counts the others' arrivals: with
`share(on_new)` it keeps its own new arrivals per (priority, client) until `take_new()` (the
SignalsLink sends them to the signals process at the end of the event-loop iteration), and
`add_peers()` adds what the other workers took. The holdback then sees the replica's arrivals,
not only those Envoy's connections happened to bring to this worker.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable

Counts = dict[tuple[int, str], int]   # arrivals per (priority, client)


class RecentArrivals:
    def __init__(self, window: float):
        if window <= 0:
            raise ValueError("the activity window must be positive")
        self.window = window
        self._events: deque[tuple[float, int, str, int]] = deque()
        self._counts: Counter[tuple[int, str]] = Counter()
        self._new: Counter[tuple[int, str]] | None = None   # own arrivals not taken yet (share)
        self._new_at = 0.0
        self._on_new: Callable[[], None] | None = None

    def share(self, on_new: Callable[[], None] | None = None) -> None:
        """Keep this worker's arrivals for take_new(); on_new is called at the first arrival
        after a take."""
        self._new = Counter()
        self._on_new = on_new

    def add(self, now: float, priority: int, client: str) -> None:
        self._record(now, priority, client, 1)
        new = self._new
        if new is not None:
            if not new and self._on_new is not None:
                self._on_new()
            new[(priority, client)] += 1
            self._new_at = now

    def take_new(self) -> tuple[float, Counts] | None:
        """This worker's arrivals since the last take: (time of the last one, counts), or None."""
        if not self._new:
            return None
        out, self._new = dict(self._new), Counter()
        return self._new_at, out

    def add_peers(self, at: float, counts: Counts) -> None:
        """Another worker's arrivals (its take_new), counted as arrived at `at`, or at the last
        arrival recorded here if that is later (the window keeps its events in time order, so a
        batch that took a while to come counts for that much longer)."""
        if self._events:
            at = max(at, self._events[-1][0])
        for (priority, client), n in counts.items():
            self._record(at, priority, client, n)

    def _record(self, at: float, priority: int, client: str, n: int) -> None:
        self._events.append((at, priority, client, n))
        self._counts[(priority, client)] += n

    def _forget(self, now: float) -> None:
        events, counts = self._events, self._counts
        while events and events[0][0] <= now - self.window:
            _, priority, client, n = events.popleft()
            key = (priority, client)
            counts[key] -= n
            if counts[key] <= 0:
                del counts[key]

    def must_hold_back(self, now: float, priority: int, client: str) -> bool:
        return self.holdback_reason(now, priority, client) is not None

    def holdback_reason(self, now: float, priority: int, client: str) -> str | None:
        """Why the request must leave room for others: "band" (a higher band is active),
        "client" (its client is over its share of its band), or None."""
        self._forget(now)
        band: dict[str, int] = {}
        for (p, c), n in self._counts.items():
            if p > priority:
                return "band"
            if p == priority:
                band[c] = n
        if len(band) >= 2 and band.get(client, 0) * len(band) > sum(band.values()):
            return "client"
        return None

    def alone(self, now: float, priority: int, client: str) -> bool:
        """No other band and no other client sent anything in the window."""
        self._forget(now)
        return all(key == (priority, client) for key in self._counts)
