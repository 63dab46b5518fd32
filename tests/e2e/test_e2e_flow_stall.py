"""Flow control through the real Envoy while every endpoint's metrics are stale for a moment
(here the engines are stopped; a stalled node, scraper or picker does the same): a request that
arrives then waits in the picker for fresh signals (--flow-stale-hold) instead of being sent to
an engine the last signals showed full. Its own stack: a short staleness bound, so the metrics
go stale (0.3 s) long before an endpoint is taken out (3 failed scrapes of 0.5 s)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.e2e.conftest import completion, start_stack, wait_for
from tests.e2e.test_e2e_flow import MAX_WAIT, drain, fill, post, queued

pytestmark = pytest.mark.e2e

STALENESS = 0.3   # --staleness (s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("flow-stall"), "flow-stall", groups=2,
                    body_mode="buffered", scrape_interval=0.05, sim_args=["--max-num-seqs", "1"],
                    picker_args_extra=["--flow-control", "--flow-max-wait", str(MAX_WAIT),
                                       "--staleness", str(STALENESS)])
    yield s
    s.stop()


async def test_a_stall_of_the_metrics_holds_new_requests_instead_of_sending_them(stack, session):
    fillers = await fill(session, stack)
    sims = [p.pid for p in stack.procs if p.name.startswith("sim-")]
    for pid in sims:
        os.killpg(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(STALENESS + 0.2)   # every scrape stale, none failed 3 times yet
        probe = asyncio.ensure_future(post(session, stack, completion(max_tokens=2), tag="stall"))
        await wait_for(lambda: queued(session, stack), timeout=0.4)   # held, not sent
    finally:
        for pid in sims:
            os.killpg(pid, signal.SIGCONT)
    status, data, _ = await asyncio.wait_for(probe, 30)
    assert status == 200, data
    await drain(fillers)
