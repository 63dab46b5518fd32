"""Flow control around the Router: hold what no endpoint can start now, dispatch it later.

    flow = FlowControl(router, FlowSettings())       # installs router.gate
    result = flow.submit(info, notify)               # Decision now, or Held (notify(result) later)
    flow.pump()                                      # on new signals and at the next deadline:
                                                     #   dispatch heads that have room, expire old
    flow.cancel(held)                                # the client went away
    flow.release_all()                               # shutting down: send every held request

Synchronous and clock-injected like the Router: the ext_proc server (protocol/extproc.py,
FlowDriver) and the routing lab drive the same code. A request is decided by Router.decide with
router.gate set: the gate keeps only the candidates with room (flowcontrol/room.py) or raises
Hold; a held request is decided again, from scratch, when it reaches the head of the queue.
If no candidate has fresh metrics, nothing is known about room: the request is held while the
newest of them is less than `stale_hold` seconds past the staleness bound (a stalled scraper or
worker, whose fresh signals come back within it; dispatching the whole queue then would undo its
order and its reserves), and not held after that (the signals are lost; the scorers already rank
stale endpoints last).

Holdback (activity.py, room.py): a request of a lower band while a higher band is active, or,
while the pool is saturated (see `_saturated`), of a client over its share of its band, needs a
reserve free beyond its own need. When the head of the queue waits for that reserve, the first
other waiting request that may use it goes instead (a light client's or a higher band's), so the
reserve is what they find. Below saturation a client keeps no reserve: every request starts as
it comes, whoever sends more; a lower band gives way to a higher one at any load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from picker import defaults
from picker.core import Decision, RequestInfo, Router
from picker.errors import PickerError
from picker.flowcontrol.activity import RecentArrivals
from picker.flowcontrol.queue import DEFAULT_CLIENT, FlowQueue, Held, QueueLimits
from picker.flowcontrol.room import RoomRule, affine_without_room, has_room
from picker.scheduling.context import SchedulingContext
from picker.signals.state import EndpointState

CLIENT_HEADER = "x-client-id"   # set by the edge from the API key (components/edge-security)
Outcome = Union[Decision, PickerError]
AT_BOUND = ("reject", "dispatch", "dispatch-uncontested")


class Hold(Exception):
    """No candidate can start the request now (raised by the gate inside Router.decide)."""


@dataclass(frozen=True, slots=True)
class FlowSettings:
    limits: QueueLimits = field(default_factory=QueueLimits)
    room: RoomRule = field(default_factory=RoomRule)
    # At the age bound a sheddable request is always refused (429); one of priority >= 0 is
    # refused (503 queue_timeout) with "reject", sent to the best endpoint as without flow control
    # with "dispatch" (it then waits in an engine's queue), and with "dispatch-uncontested" sent
    # only if no other band and no other client sent anything in the activity window (an
    # engine's FIFO then serves it in the order the picker would), else refused: in an engine's
    # queue it would go ahead of the others' later requests, and its queue closes the engine's
    # room to all of them.
    at_bound: str = defaults.FLOW_AT_BOUND
    activity_window: float = defaults.FLOW_ACTIVITY_WINDOW   # seconds of arrivals for holdback
    stale_hold: float = defaults.FLOW_STALE_HOLD   # seconds past the staleness bound still held

    def __post_init__(self):
        if self.at_bound not in AT_BOUND:
            raise ValueError(f"at_bound must be one of {', '.join(AT_BOUND)}, not {self.at_bound!r}")
        if self.activity_window <= 0:
            raise ValueError("the activity window must be positive")
        if self.stale_hold < 0:
            raise ValueError("the stale hold must be >= 0")


def _refusal(priority: int, message: str, code: str) -> PickerError:
    """Sheddable requests get 429 (drop it, the pool is busy), the others 503 (retry later)."""
    return PickerError(429 if priority < 0 else 503, message, code)


class FlowControl:
    def __init__(self, router: Router, settings: FlowSettings | None = None):
        self.router = router
        self.settings = settings or FlowSettings()
        self.queue = FlowQueue(self.settings.limits)
        self.metrics = router.metrics
        self.arrivals = RecentArrivals(self.settings.activity_window)
        router.gate = self._gate
        self._holdback: str | None = None   # for the request being decided: see _decide
        self._published: dict[int, int] = {}
        self._closing = False   # release_all ran: nothing is held any more
        self._stale_until: float | None = None   # holding on stale signals ends then
        # Saturated: a request found no endpoint with room (even without a reserve), and since
        # then requests have waited in the queue or been refused within an activity window.
        # Only then does a client over its share keep the reserve: below saturation every
        # request starts as it comes, and holding whoever sends more requests would delay it
        # while nobody gains. The reserve's own holds cannot start it (they wait where there is
        # room without the reserve); once started it lasts while a backlog does, so a lull does
        # not lift the reserve into a heavy client's next burst.
        self._saturated = False
        self._refused_at: float | None = None   # the last request refused or sent at its bound

    def _gate(self, ctx: SchedulingContext, candidates: list[EndpointState]) -> list[EndpointState]:
        if self._closing:
            return candidates
        rule = self.settings.room
        room = [e for e in candidates if has_room(e, ctx, rule)]
        if not room and any(e.metrics is not None and not e.stale and not e.failing for e in candidates):
            self._saturated = True     # no room even without a reserve
        elif self._saturated and not len(self.queue) and not self._refused_lately():
            self._saturated = False    # nothing waits, nothing was refused for an activity window
        if room and (self._holdback == "band" or (self._holdback == "client" and self._saturated)):
            room = [e for e in room if has_room(e, ctx, rule, holdback=True)]
            if not room:
                raise Hold()
            return room
        if room:
            return room + affine_without_room(ctx, candidates, room, rule)
        if all(e.stale or e.metrics is None for e in candidates) and not self._stale_briefly(candidates):
            return candidates  # signals lost: hold nothing
        raise Hold()

    def _refused_lately(self) -> bool:
        at = self._refused_at
        return at is not None and self.router.clock() - at < self.settings.activity_window

    def _stale_briefly(self, candidates: list[EndpointState]) -> bool:
        """The newest candidate metrics are less than `stale_hold` past the staleness bound."""
        newest = max((e.scraped_at for e in candidates if e.scraped_at is not None), default=None)
        if newest is None:
            return False
        until = newest + self.router.settings.staleness + self.settings.stale_hold
        if self.router.clock() >= until:
            return False
        self._stale_until = until
        return True

    def submit(self, info: RequestInfo, notify: Callable[[Outcome], None]) -> Decision | Held:
        """Decide now if nothing waits ahead and an endpoint has room, else queue. Raises the
        request's own PickerError (bad body, no endpoint...) or a refusal (queue full)."""
        _, priority = self.router._objective(info.headers)
        client = info.headers.get(CLIENT_HEADER, "") or DEFAULT_CLIENT
        now = self.router.clock()
        self.arrivals.add(now, priority, client)
        first = not len(self.queue)
        if first:
            try:
                return self._decide(info, priority, client, now)
            except Hold:
                pass
        held, evicted = self.queue.push(priority, client, now, info)
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
        if not first and (self.queue.peek() is held or self._may_pass_head(held, now)):
            self.pump()   # ahead of the others, or it may use the reserve the head leaves
        self.publish()
        return held

    def cancel(self, held: Held) -> None:
        """The client went away while its request was held: it leaves the queue at once."""
        if held.queued:
            self.queue.remove(held)
            self._count("cancelled", held.priority)
            self.publish()

    def release_all(self) -> int:
        """The replica is shutting down: every held request is decided at once without the room
        test (early binding, as without flow control), in the queue's order, so its client is
        served from an engine's queue instead of losing the request with the picker's stream.
        Returns the number sent. Requests that arrive after it are not held either (their
        streams have only the server's grace left)."""
        self._closing = True
        now = self.router.clock()
        sent = 0
        while (h := self.queue.peek()) is not None:
            self.queue.pop(h)
            try:
                decision = self._decide_ungated(h)
            except PickerError as err:  # e.g. no endpoint left: the request's own error
                self._leave(h, "error", err, popped=True)
                continue
            self._send(h, decision, now, "shutdown_dispatch")
            sent += 1
        self.publish()
        return sent

    def pump(self) -> int:
        """Expire requests past their age bound, then dispatch from the head while the head's
        request has room. Returns the number dispatched."""
        now = self.router.clock()
        for h in self.queue.expired(now):
            if self._sent_at_bound(h, now):
                continue
            bound = self.queue.limits.wait_bound(h.priority)
            self._leave(h, "expired", _refusal(
                h.priority, f"waited {now - h.arrived:.1f}s in the endpoint picker's queue (bound "
                            f"{bound:g}s) without an endpoint able to start it", "queue_timeout"))
        sent = 0
        while (step := self._next_decision(now)) is not None:
            h, outcome = step
            self.queue.pop(h)
            if isinstance(outcome, PickerError):  # e.g. every endpoint went away while it waited
                self._leave(h, "error", outcome, popped=True)
                continue
            sent += 1
            if self.metrics is not None:
                self.metrics.flow_wait.observe(now - h.arrived)
            h.notify(outcome)
        self.publish()
        return sent

    def _next_decision(self, now: float) -> tuple[Held, Outcome] | None:
        """The head of the queue with its decision; if the head holds back and waits for the
        reserve, the first waiting request that may use the reserve. None: nothing can go now."""
        head = self.queue.peek()
        if head is None:
            return None
        try:
            return head, self._decide_held(head, now)
        except Hold:
            pass
        except PickerError as err:
            return head, err
        other = self._reserve_user(now) if self._holds_back(head, now) else None
        if other is None:
            return None
        try:
            return other, self._decide_held(other, now)
        except Hold:
            return None
        except PickerError as err:
            return other, err

    def _holds_back(self, h: Held, now: float) -> bool:
        return self.arrivals.must_hold_back(now, h.priority, h.client)

    def _may_pass_head(self, h: Held, now: float) -> bool:
        head = self.queue.peek()
        return self._holds_back(head, now) and not self._holds_back(h, now)

    def _reserve_user(self, now: float) -> Held | None:
        """The first waiting request, in dispatch order, that may use the reserve."""
        for h in self.queue.heads():
            if not self._holds_back(h, now):
                return h
        return None

    def _decide(self, info: RequestInfo, priority: int, client: str, now: float) -> Decision:
        self._holdback = self.arrivals.holdback_reason(now, priority, client)
        try:
            return self.router.decide(info)
        finally:
            self._holdback = None

    def _decide_held(self, h: Held, now: float) -> Decision:
        return self._decide(h.payload, h.priority, h.client, now)

    def _sent_at_bound(self, h: Held, now: float) -> bool:
        mode = self.settings.at_bound
        if h.priority < 0 or mode == "reject":
            return False
        if mode == "dispatch-uncontested" and not self.arrivals.alone(now, h.priority, h.client):
            return False
        return self._dispatch_ungated(h, now)

    def _dispatch_ungated(self, h: Held, now: float) -> bool:
        """Early binding for a request at its age bound: decided without the room test."""
        try:
            decision = self._decide_ungated(h)
        except PickerError:
            return False
        self._send(h, decision, now, "bound_dispatch")
        return True

    def _decide_ungated(self, h: Held) -> Decision:
        gate, self.router.gate = self.router.gate, None
        try:
            return self.router.decide(h.payload)
        finally:
            self.router.gate = gate

    def _send(self, h: Held, decision: Decision, now: float, reason: str) -> None:
        self._count(reason, h.priority)
        if self.metrics is not None:
            self.metrics.flow_wait.observe(now - h.arrived)
        h.notify(decision)

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
        """The queue's next age bound, or sooner the end of holding on stale signals."""
        deadline = self.queue.next_deadline()
        until = self._stale_until
        if until is None or deadline is None:
            return deadline
        if until <= self.router.clock():
            self._stale_until = None
            return deadline
        return min(deadline, until)

    def _leave(self, h: Held, reason: str, err: PickerError, popped: bool = False) -> None:
        if not popped:
            self.queue.remove(h)
        self._count(reason, h.priority)
        if h.notify is not None:
            h.notify(err)

    def _count(self, reason: str, priority: int) -> None:
        if reason in ("expired", "evicted", "queue_full", "bound_dispatch"):
            self._refused_at = self.router.clock()
        if self.metrics is not None:
            self.metrics.flow_evictions.labels(reason, str(priority)).inc()
