"""Flow control around the Router: hold what no endpoint can start now, dispatch it later.

    flow = FlowControl(router, FlowSettings())       # installs router.gate
    result = flow.submit(info, notify)               # Decision now, or Held (notify(result) later)
    flow.pump()                                      # on new signals and at the next deadline:
                                                     #   dispatch heads that have room, expire old
    flow.cancel(held)                                # the client went away

Synchronous and clock-injected like the Router: the ext_proc server (protocol/extproc.py,
FlowDriver) and the routing lab drive the same code. A request is decided by Router.decide with
router.gate set: the gate keeps only the candidates with room (flowcontrol/room.py) or raises
Hold; a held request is decided again, from scratch, when it reaches the head of the queue.
If no candidate has fresh metrics, nothing is known about room and the request is not held
(the scorers already rank stale endpoints last).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from picker import defaults
from picker.core import Decision, RequestInfo, Router
from picker.errors import PickerError
from picker.flowcontrol.queue import FlowQueue, Held, QueueLimits
from picker.flowcontrol.room import RoomRule, has_room
from picker.scheduling.context import SchedulingContext
from picker.signals.state import EndpointState

CLIENT_HEADER = "x-client-id"   # set by the edge from the API key (components/edge-security)
Outcome = Union[Decision, PickerError]


class Hold(Exception):
    """No candidate can start the request now (raised by the gate inside Router.decide)."""


@dataclass(frozen=True, slots=True)
class FlowSettings:
    limits: QueueLimits = field(default_factory=QueueLimits)
    room: RoomRule = field(default_factory=RoomRule)
    # At the age bound a request of priority >= 0 is refused (503 queue_timeout), or with
    # dispatch_at_bound sent to the best endpoint as without flow control (it then waits in an
    # engine's queue); sheddable requests are always refused (429).
    dispatch_at_bound: bool = defaults.FLOW_AT_BOUND == "dispatch"


def _refusal(priority: int, message: str, code: str) -> PickerError:
    """Sheddable requests get 429 (drop it, the pool is busy), the others 503 (retry later)."""
    return PickerError(429 if priority < 0 else 503, message, code)


class FlowControl:
    def __init__(self, router: Router, settings: FlowSettings | None = None):
        self.router = router
        self.settings = settings or FlowSettings()
        self.queue = FlowQueue(self.settings.limits)
        self.metrics = router.metrics
        router.gate = self._gate
        self._published: dict[int, int] = {}

    def _gate(self, ctx: SchedulingContext, candidates: list[EndpointState]) -> list[EndpointState]:
        rule = self.settings.room
        room = [e for e in candidates if has_room(e, ctx, rule)]
        if room:
            return room
        if all(e.stale or e.metrics is None for e in candidates):
            return candidates  # nothing known: hold nothing
        raise Hold()

    def submit(self, info: RequestInfo, notify: Callable[[Outcome], None]) -> Decision | Held:
        """Decide now if nothing waits ahead and an endpoint has room, else queue. Raises the
        request's own PickerError (bad body, no endpoint...) or a refusal (queue full)."""
        first = not len(self.queue)
        if first:
            try:
                return self.router.decide(info)
            except Hold:
                pass
        _, priority = self.router._objective(info.headers)
        now = self.router.clock()
        held, evicted = self.queue.push(priority, info.headers.get(CLIENT_HEADER, ""), now, info)
        if evicted is not None:
            self._leave(evicted, "evicted", _refusal(
                evicted.priority, "evicted from the endpoint picker's full queue by a request of "
                                  "higher priority", "queue_evicted"))
        if held is None:
            self._count("queue_full", priority)
            raise _refusal(priority, f"the endpoint picker's queue is full "
                                     f"({self.queue.limits.max_requests} requests) and no "
                                     f"endpoint can start this request now", "queue_full")
        held.notify = notify
        if self.metrics is not None:
            self.metrics.flow_held.labels(str(priority)).inc()
        if not first and self.queue.peek() is held:  # ahead of the others (priority): try it now
            self.pump()
        self.publish()
        return held

    def cancel(self, held: Held) -> None:
        """The client went away while its request was held: it leaves the queue at once."""
        if held.queued:
            self.queue.remove(held)
            self._count("cancelled", held.priority)
            self.publish()

    def pump(self) -> int:
        """Expire requests past their age bound, then dispatch from the head while the head's
        request has room. Returns the number dispatched."""
        now = self.router.clock()
        for h in self.queue.expired(now):
            if self.settings.dispatch_at_bound and h.priority >= 0 and self._dispatch_ungated(h, now):
                continue
            bound = self.queue.limits.wait_bound(h.priority)
            self._leave(h, "expired", _refusal(
                h.priority, f"waited {now - h.arrived:.1f}s in the endpoint picker's queue (bound "
                            f"{bound:g}s) without an endpoint able to start it", "queue_timeout"))
        sent = 0
        while True:
            h = self.queue.peek()
            if h is None:
                break
            try:
                decision = self.router.decide(h.payload)
            except Hold:
                break
            except PickerError as err:  # e.g. every endpoint went away while it waited
                self.queue.pop(h)
                self._leave(h, "error", err, popped=True)
                continue
            self.queue.pop(h)
            sent += 1
            if self.metrics is not None:
                self.metrics.flow_wait.observe(now - h.arrived)
            h.notify(decision)
        self.publish()
        return sent

    def _dispatch_ungated(self, h: Held, now: float) -> bool:
        """Early binding for a request at its age bound: decided without the room test."""
        gate, self.router.gate = self.router.gate, None
        try:
            decision = self.router.decide(h.payload)
        except PickerError:
            return False
        finally:
            self.router.gate = gate
        self._count("bound_dispatch", h.priority)
        if self.metrics is not None:
            self.metrics.flow_wait.observe(now - h.arrived)
        h.notify(decision)
        return True

    def publish(self) -> None:
        """The queue length per priority into the metrics (only the bands that changed)."""
        if self.metrics is None:
            return
        sizes = self.queue.sizes()
        for priority in set(sizes) | set(self._published):
            n = sizes.get(priority, 0)
            if self._published.get(priority) != n:
                self.metrics.flow_queued.labels(str(priority)).set(n)
                self._published[priority] = n

    def next_deadline(self) -> float | None:
        return self.queue.next_deadline()

    def _leave(self, h: Held, reason: str, err: PickerError, popped: bool = False) -> None:
        if not popped:
            self.queue.remove(h)
        self._count(reason, h.priority)
        if h.notify is not None:
            h.notify(err)

    def _count(self, reason: str, priority: int) -> None:
        if self.metrics is not None:
            self.metrics.flow_evictions.labels(reason, str(priority)).inc()
