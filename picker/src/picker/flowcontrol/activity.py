"""Who sent requests lately: the arrivals of the last `window` seconds per priority and client.

The controller asks it whether a request must leave room for others (room.py, holdback):
- a higher priority band had arrivals in the window (its next request should find a free slot);
- or the request's client sent more than its share of its band's arrivals in the window
  (share = 1 / clients seen in the band), so a light client next to a heavy one finds a slot.
A single client of a single band never holds back: without competition nothing changes. It is
also the one case where sending a request to an engine's queue at its age bound costs nobody
their order (`alone`): the engine's FIFO serves it as the picker's queue would.
"""
from __future__ import annotations

from collections import Counter, deque


class RecentArrivals:
    def __init__(self, window: float):
        if window <= 0:
            raise ValueError("the activity window must be positive")
        self.window = window
        self._events: deque[tuple[float, int, str]] = deque()
        self._counts: Counter[tuple[int, str]] = Counter()

    def add(self, now: float, priority: int, client: str) -> None:
        self._events.append((now, priority, client))
        self._counts[(priority, client)] += 1

    def _forget(self, now: float) -> None:
        events, counts = self._events, self._counts
        while events and events[0][0] <= now - self.window:
            _, priority, client = events.popleft()
            key = (priority, client)
            counts[key] -= 1
            if not counts[key]:
                del counts[key]

    def must_hold_back(self, now: float, priority: int, client: str) -> bool:
        self._forget(now)
        band: dict[str, int] = {}
        for (p, c), n in self._counts.items():
            if p > priority:
                return True
            if p == priority:
                band[c] = n
        if len(band) < 2:
            return False
        return band.get(client, 0) * len(band) > sum(band.values())

    def alone(self, now: float, priority: int, client: str) -> bool:
        """No other band and no other client sent anything in the window."""
        self._forget(now)
        return all(key == (priority, client) for key in self._counts)
