"""The flow-control queue: priority bands, round robin over clients within a band, bounds.

Pure data structure, no clock and no I/O: callers pass `now`. One queue per picker worker.

- Bands: one per InferenceObjective priority; higher priority is served first, FIFO per client.
- Fairness: within a band, clients (the edge's `x-client-id`) take turns, one request each
  (round robin). A client sending 10x the rate of another gets no more turns than it while both
  have requests waiting, so a light client waits behind at most one request of each other
  client in its band. Turns are per request, not per token: output lengths are unknown when a
  request is dispatched (`max_tokens` is only a cap), so a per-token weight would be a guess.
- Starvation bound: after `strict_turns` dispatches in a row from higher bands while a lower
  band waits, the oldest waiting request of the lower bands goes next. A waiting request of any
  band is therefore served within (strict_turns + 1) x (requests ahead of it) dispatches.
- Bounds: at most `max_requests` held in all; per band the age bound `max_wait` (sheddable
  bands, priority < 0: `max_wait_sheddable`). A request over its age bound leaves with
  `expired`; when the queue is full, a newcomer of higher priority than the lowest waiting band
  evicts that band's newest request (`evicted`), else the newcomer is refused (`queue_full`).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from picker import defaults

DEFAULT_CLIENT = ""  # requests without a client id share one flow


@dataclass(frozen=True, slots=True)
class QueueLimits:
    max_requests: int = defaults.FLOW_MAX_REQUESTS        # held at once, all bands
    max_wait: float = defaults.FLOW_MAX_WAIT              # seconds, priority >= 0
    max_wait_sheddable: float = defaults.FLOW_MAX_WAIT_SHEDDABLE  # seconds, priority < 0
    strict_turns: int = defaults.FLOW_STRICT_TURNS  # top-band dispatches before a lower band's turn

    def __post_init__(self):
        if self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")
        if self.max_wait <= 0 or self.max_wait_sheddable <= 0:
            raise ValueError("the queue's age bounds must be positive")
        if self.strict_turns < 1:
            raise ValueError("strict_turns must be at least 1")

    def wait_bound(self, priority: int) -> float:
        return self.max_wait_sheddable if priority < 0 else self.max_wait


@dataclass(eq=False, slots=True)
class Held:
    """One waiting request."""
    priority: int
    client: str
    arrived: float
    deadline: float
    payload: Any = None
    seq: int = 0
    queued: bool = True   # False once it left the queue (dispatched, expired, evicted, cancelled)
    notify: Any = None    # the owner's callback for the outcome (flowcontrol.controller)


@dataclass(slots=True)
class _Band:
    priority: int
    clients: "OrderedDict[str, deque[Held]]" = field(default_factory=OrderedDict)
    size: int = 0

    def push(self, item: Held) -> None:
        q = self.clients.get(item.client)
        if q is None:
            q = self.clients[item.client] = deque()
        q.append(item)
        self.size += 1

    def peek(self) -> Held | None:
        """The next request by round robin: the head of the client whose turn it is."""
        for client, q in self.clients.items():
            return q[0]
        return None

    def pop(self) -> Held:
        client, q = next(iter(self.clients.items()))
        item = q.popleft()
        self.size -= 1
        del self.clients[client]
        if q:  # back of the line: the next client takes its turn
            self.clients[client] = q
        return item

    def remove(self, item: Held) -> None:
        q = self.clients.get(item.client)
        if q is None:
            return
        q.remove(item)
        self.size -= 1
        if not q:
            del self.clients[item.client]

    def oldest(self) -> Held | None:
        heads = [q[0] for q in self.clients.values()]
        return min(heads, key=lambda h: h.seq) if heads else None

    def newest(self) -> Held | None:
        tails = [q[-1] for q in self.clients.values()]
        return max(tails, key=lambda h: h.seq) if tails else None


class FlowQueue:
    def __init__(self, limits: QueueLimits | None = None):
        self.limits = limits or QueueLimits()
        self.bands: dict[int, _Band] = {}
        self.size = 0
        self._seq = itertools.count()
        self._strict_run = 0  # dispatches in a row from the top band while a lower one waited

    def __len__(self) -> int:
        return self.size

    def sizes(self) -> dict[int, int]:
        return {p: b.size for p, b in self.bands.items()}

    def push(self, priority: int, client: str, now: float, payload: Any = None
             ) -> tuple[Held | None, Held | None]:
        """Queue a request: (held or None if refused as `queue_full`, request evicted for it)."""
        evicted = None
        if self.size >= self.limits.max_requests:
            lowest = min(p for p, b in self.bands.items() if b.size)
            if lowest >= priority:
                return None, None
            evicted = self.bands[lowest].newest()
            self.remove(evicted)
        item = Held(priority, client or DEFAULT_CLIENT, now,
                    now + self.limits.wait_bound(priority), payload, next(self._seq))
        band = self.bands.get(priority)
        if band is None:
            band = self.bands[priority] = _Band(priority)
        band.push(item)
        self.size += 1
        return item, evicted

    def remove(self, item: Held) -> None:
        """Take a request out (client gone, or evicted); no-op if it already left."""
        if not item.queued:
            return
        item.queued = False
        band = self.bands[item.priority]
        band.remove(item)
        self.size -= 1
        if not band.size:
            del self.bands[item.priority]

    def peek(self) -> Held | None:
        """The request that goes next (see the module doc for the order)."""
        if not self.size:
            return None
        order = sorted((p for p, b in self.bands.items() if b.size), reverse=True)
        if len(order) > 1 and self._strict_run >= self.limits.strict_turns:
            lower = [self.bands[p].oldest() for p in order[1:]]
            return min(lower, key=lambda h: h.seq)
        return self.bands[order[0]].peek()

    def heads(self) -> list[Held]:
        """Each client's next request: bands from the highest, clients in their turn order."""
        return [q[0] for p in sorted(self.bands, reverse=True) for q in self.bands[p].clients.values()]

    def pop(self, item: Held) -> None:
        """`item` (from peek, or one of heads) was dispatched."""
        top = max(p for p, b in self.bands.items() if b.size)
        lower_waiting = any(b.size for p, b in self.bands.items() if p < top)
        if item.priority == top:
            self._strict_run = self._strict_run + 1 if lower_waiting else 0
        else:
            self._strict_run = 0
        band = self.bands[item.priority]
        if band.peek() is item:
            item.queued = False
            band.pop()
            self.size -= 1
            if not band.size:
                del self.bands[item.priority]
        else:
            self.remove(item)

    def expired(self, now: float) -> list[Held]:
        """Remove and return every request past its age bound."""
        out = []
        for band in list(self.bands.values()):
            for q in list(band.clients.values()):
                # one age bound per band: a client's requests expire in arrival order
                while q and q[0].deadline <= now:
                    out.append(q[0])
                    self.remove(q[0])
        return out

    def next_deadline(self) -> float | None:
        deadlines = [q[0].deadline for b in self.bands.values() for q in b.clients.values()]
        return min(deadlines) if deadlines else None
