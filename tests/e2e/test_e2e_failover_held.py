"""Requests held in flow control survive their replica's crash through the real Envoy: the acting
leader holds requests no engine can start now, it is killed (SIGKILL of its whole process group),
and each held request is decided by the standby and served. With the body streamed
(FullDuplexStreamed, base/gateway) the picker sends nothing on a held stream before its
decision, so Envoy retries the broken stream on the other replica (base/gateway's `reset`
retry), replaying what it sent; with Buffered bodies the headers are answered first, so such a
stream is past retrying and fails at once with 503 (tests/e2e/test_e2e_flow.py shows that with
one picker).

Room is made scarce as in test_e2e_flow.py: 2 simulated groups running one request at a time and
long `filler` requests. Why ~1 minute: one stack with etcd and kube-apiserver."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import aiohttp
import pytest

from local.stack.processes import free_ports, grpc_serving
from tests.e2e.conftest import SPEEDUP, completion, scrape, wait_for

pytestmark = pytest.mark.e2e

FILLER_TOKENS = 3000      # ~3 s per filler at the e2e speedup (100x)
MAX_WAIT = 20.0           # --flow-max-wait: the held requests wait for room, not for the bound


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from local.stack import Stack, StackConfig
    ports = free_ports(14)
    config = StackConfig(
        name="failover-held", run_root=tmp_path_factory.mktemp("held"), groups=2, speedup=SPEEDUP,
        seed=7, body_mode="full-duplex", sim_ports=ports[:2], http_port=ports[2], llm_port=ports[3],
        picker_grpc_port=ports[4], picker_health_port=ports[5], picker_metrics_port=ports[6],
        picker_peer_port=ports[7], picker_outcomes_port=ports[8], pickers=2,
        replica_ports=[ports[9:14]], sim_args=["--max-num-seqs", "1"],
        picker_args=["--scrape-interval", "0.05", "--flow-control", "--flow-max-wait", str(MAX_WAIT),
                     "--flow-max-requests", "3", "--leader-election-lease-duration", "2",
                     "--leader-election-renew-deadline", "1.5", "--leader-election-retry-period",
                     "0.25", "--drain-seconds", "0.5"],
        startup_timeout=120)
    s = Stack(config).start()
    yield s
    s.stop()


def leader(stack) -> int:
    c = stack.config
    acting = [i for i in range(c.pickers)
              if grpc_serving(f"{c.host}:{c.picker_ports(i)[1]}", service="readiness")]
    assert len(acting) == 1, acting
    return acting[0]


async def metric(session, stack, i: int, name: str) -> float:
    url = f"http://127.0.0.1:{stack.config.picker_ports(i)[2]}/metrics"
    return sum(v for n, _, v in await scrape(session, url) if n == name)


async def post(session, stack, body: dict, tag: str) -> tuple[int, dict]:
    async with session.post(f"http://127.0.0.1:{stack.llm_port}/v1/completions", json=body,
                            headers={"x-request-id": f"{tag}-{uuid.uuid4()}"}) as r:
        return r.status, await r.json(content_type=None)


async def test_requests_held_by_a_killed_leader_are_decided_by_the_standby(stack):
    async with aiohttp.ClientSession(headers=stack.auth_headers(),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        lead = leader(stack)
        fillers = []
        for i in range(4):   # every engine running one, one waiting: no room anywhere
            fillers.append(asyncio.ensure_future(post(session, stack, completion(
                prompt=f"filler {i} " * 50, max_tokens=FILLER_TOKENS, ignore_eos=True), "filler")))
            await asyncio.sleep(0.15)   # a scrape between two sends: the picker sees each one

        async def saturated():   # as test_e2e_flow.py: held requests are sent once no room is left
            url = f"http://127.0.0.1:{stack.config.picker_ports(lead)[2]}/metrics"
            waiting = [v for n, _, v in await scrape(session, url) if n == "picker_endpoint_queue"]
            return len(waiting) == 2 and all(w >= 1 for w in waiting)
        await wait_for(saturated, timeout=10)
        held = [asyncio.ensure_future(post(session, stack, completion(max_tokens=2), "held"))
                for _ in range(3)]

        async def all_held():
            return await metric(session, stack, lead, "picker_flow_queued_requests") == 3
        await wait_for(all_held, timeout=10)
        killed_at = time.monotonic()
        name = stack.config.picker_name(lead)
        stack.signal_process(name, signal.SIGKILL)
        stack.proc(name).popen.wait(timeout=10)
        results = await asyncio.wait_for(asyncio.gather(*held), MAX_WAIT + 10)
        waited = time.monotonic() - killed_at
        standby = 1 - lead
        decided = await metric(session, stack, standby, "picker_requests_total")
        print(f"\nleader killed holding 3 requests: {[s for s, _ in results]} "
              f"{waited:.2f} s after the kill; the standby decided {decided:.0f}")
        for status, data in results:
            assert status == 200 and data["choices"][0]["text"], (status, data)
        assert decided >= 3           # the standby decided them (the leader never answered)
        for status, data in await asyncio.gather(*fillers):
            assert status == 200, data   # already on an engine: the crash did not touch them
        await asyncio.to_thread(stack.restart_process, name)
