"""The asyncio driver of FlowControl in the ext_proc server: pump on new signals (coalesced to
once per event-loop iteration) and at the queue's next deadline."""
from __future__ import annotations

import asyncio

from picker.flowcontrol.controller import FlowControl


class FlowDriver:
    def __init__(self, flow: FlowControl):
        self.flow = flow
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        flow.router.on_signals = self.poke

    def poke(self) -> None:
        """New signals (a scrape): try the queue's head again, once per loop iteration."""
        if not self._scheduled and len(self.flow.queue):
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        self.flow.pump()
        self.arm()

    def arm(self) -> None:
        """A timer at the next age bound of the queue."""
        deadline = self.flow.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            delay = max(0.0, deadline - self.flow.router.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        self._run()
