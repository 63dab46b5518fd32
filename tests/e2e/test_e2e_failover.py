"""The picker fails over under load, through the real Envoy, as base/picker and base/gateway deploy
it: 2 replicas active-passive on a Lease of a real API server, linked, both in the gateway's
picker Backend behind Envoy's gRPC health checks (the local stack with `pickers=2`). Steady
streamed completions on 8081 while the acting leader gets SIGTERM (a rolling update), SIGKILL
(a crash), SIGSTOP (a hung replica) or the API server stops answering; each case checks its
target and records its figures (`python -m bench failover` runs this module with
FAILOVER_BENCH=1: a minute around each fault, the hang 10 s and the outage 30 s, and writes
BENCHMARKS.md's section from what it records).

Targets (docs/failover.md): SIGTERM and an API outage lose nothing; after a SIGKILL nothing that
arrives later fails, the streams the dead replica had open fail at once with a clean 503 (counted),
and the degraded window is under a second; a hung leader never holds a request longer than the
ext_proc messageTimeout (35 s), and a standby takes over.

Why this takes ~3 minutes: two stacks (one per body mode; each ~40 s to start with etcd and
kube-apiserver), the full-duplex one through four faults, the buffered one through the two
that cut streams."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import pytest

from local.stack.control_plane import read_lease
from local.stack.processes import free_ports, grpc_serving
from tests.e2e.conftest import SCRAPE_INTERVAL, SPEEDUP, completion, scrape, wait_for

pytestmark = pytest.mark.e2e

BENCH = os.environ.get("FAILOVER_BENCH") == "1"
AROUND = 30.0 if BENCH else 2.5     # s of steady load before and after each fault
HANG = 10.0 if BENCH else 2.5       # s the leader stays stopped (SIGSTOP)
OUTAGE = 30.0 if BENCH else 4.0     # s the API server stays stopped (> the lease duration)
RATE = 50.0                         # requests/s (below the `loadtest` key's rate limit)
MESSAGE_TIMEOUT = 35.0              # base/gateway's ext_proc messageTimeout
SETTLE = 5.0                        # s after a fault (its end) in which a slow request counts
# The test-sized Lease: a dead leader's Lease expires after 2 s (the API outage outlasts it)
LEASE = ["--leader-election-lease-duration", "2", "--leader-election-renew-deadline", "1.5",
         "--leader-election-retry-period", "0.25"]


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    from local.stack import Stack, StackConfig
    mode = request.param
    ports = free_ports(15)
    config = StackConfig(
        name=f"failover-{mode}", run_root=tmp_path_factory.mktemp("failover"), groups=3,
        speedup=SPEEDUP, seed=7, body_mode=mode, sim_ports=ports[:3], http_port=ports[3],
        llm_port=ports[4], picker_grpc_port=ports[5], picker_health_port=ports[6],
        picker_metrics_port=ports[7], picker_peer_port=ports[8], picker_outcomes_port=ports[9],
        pickers=2, replica_ports=[ports[10:15]],
        picker_args=["--scrape-interval", str(SCRAPE_INTERVAL), "--drain-seconds", "0.5", *LEASE],
        startup_timeout=120)
    s = Stack(config).start()
    yield s
    s.stop()


@dataclass
class Sent:
    sent: float
    done: float = 0.0
    status: int = 0
    ttft: float | None = None
    error: str = ""           # the body (or exception) of a failed request, cut

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class Load:
    """Streamed completions to 8081 at RATE a second, each recorded."""
    url: str
    headers: dict
    sent: list[Sent] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with aiohttp.ClientSession(headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=MESSAGE_TIMEOUT + 10)) as s:
            tasks, i = [], 0
            start = time.monotonic()
            while not self.stop.is_set():
                tasks.append(asyncio.ensure_future(self.one(s, i)))
                i += 1
                await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))
            await asyncio.gather(*tasks)

    async def one(self, s: aiohttp.ClientSession, i: int) -> None:
        r = Sent(time.monotonic())
        self.sent.append(r)
        body = completion(prompt=f"failover client request {i} " * 8, max_tokens=6, stream=True)
        try:
            async with s.post(self.url, json=body, headers={"x-request-id": f"failover-{uuid.uuid4()}"}) as resp:
                r.status = resp.status
                if resp.status != 200:
                    r.error = (resp.headers.get("x-picker-error", "") + " " + (await resp.text())[:200]).strip() \
                        or "empty body"
                else:
                    done = False
                    async for line in resp.content:
                        if r.ttft is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                            r.ttft = time.monotonic() - r.sent
                        done = done or line.strip() == b"data: [DONE]"
                    if not done:
                        r.error = "stream ended without [DONE]"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            r.error = repr(exc)[:200]
        r.done = time.monotonic()


def acting(stack) -> list[str]:
    """The picker replicas whose readiness says SERVING (what Envoy's health check sees)."""
    c = stack.config
    return [c.picker_name(i) for i in range(c.pickers)
            if grpc_serving(f"{c.host}:{c.picker_ports(i)[1]}", service="readiness")]


async def labelled(stack, name: str, metric: str) -> dict[str, float]:
    """A picker replica's `metric` by its one label's value."""
    c = stack.config
    i = [c.picker_name(j) for j in range(c.pickers)].index(name)
    async with aiohttp.ClientSession() as s:
        rows = await scrape(s, f"http://{c.host}:{c.picker_ports(i)[2]}/metrics")
    return {labels.split('"')[1]: v for n, labels, v in rows if n == metric}


async def failovers(stack, name: str) -> dict[str, float]:
    return await labelled(stack, name, "picker_failovers_total")


async def linked(stack) -> bool:
    """Every replica hears every other one live on the link (what keeps a standby routing as the
    leader does, and lets it see the leader hang)."""
    names = [stack.config.picker_name(i) for i in range(stack.config.pickers)]
    live = [(await labelled(stack, n, "picker_peers")).get("live") for n in names]
    return live == [len(names) - 1] * len(names)


async def ext_proc_failed_open(stack) -> int:
    """Envoy's count of requests let through without the picker's answer (failOpen)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{stack.envoy_admin()}/stats?format=json") as r:
            stats = (await r.json())["stats"]
    return int(sum(x.get("value", 0) for x in stats if x.get("name", "").endswith("failure_mode_allowed")))


async def envoy_routes_to(stack) -> list[str]:
    """The picker replicas Envoy's health checks pass on the ext_proc cluster (where it sends
    streams; none or both would mean panic routing, both replicas deciding)."""
    c = stack.config
    names = {c.picker_ports(i)[0]: c.picker_name(i) for i in range(c.pickers)}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{stack.envoy_admin()}/clusters?format=json") as r:
            clusters = (await r.json())["cluster_statuses"]
    hosts = [h for cl in clusters if "/extproc/" in cl["name"] for h in cl.get("host_statuses", [])]
    return [names.get(h["address"]["socket_address"]["port_value"], "?") for h in hosts
            if set(h.get("health_status", {})) == {"eds_health_status"}]


def figures(load: Load, fault_at: float, end_at: float, open_at_fault: list[Sent], unrouted: int) -> dict:
    """What a client saw in the window around the fault (seconds relative to it)."""
    window = [r for r in load.sent if fault_at - AROUND <= r.sent <= end_at + AROUND]
    before = [r.ttft for r in window if r.sent < fault_at and r.ttft is not None]
    slow = 2 * statistics.quantiles(before, n=100)[98] + 0.1 if len(before) >= 20 else 1.0
    # affected: still running at the fault or sent until SETTLE s after it ended, and failed or
    # its first token later than twice the steady P99 (+100 ms); later slow requests are this
    # busy machine's, not the fault's
    affected = [r for r in window if r.done >= fault_at and r.sent <= end_at + SETTLE and
                (not r.ok or r.ttft is None or r.ttft > slow)]
    ttfts = sorted(r.ttft * 1000 for r in window if r.ttft is not None)
    failed_after = [r for r in window if r.sent >= fault_at and not r.ok]
    return {
        "requests": len(window),
        "failed": sum(not r.ok for r in window),
        "failed_arriving_after": len(failed_after),
        "open_at_fault": len(open_at_fault),
        "open_at_fault_failed": sum(not r.ok for r in open_at_fault),
        "open_at_fault_failed_within_s": round(max([r.done - fault_at for r in open_at_fault if not r.ok],
                                                   default=0.0), 3),
        "unrouted": unrouted,
        "degraded_from_s": round(min(r.sent for r in affected) - fault_at, 3) if affected else None,
        "degraded_window_s": round(max(r.done for r in affected) - min(r.sent for r in affected), 3)
        if affected else 0.0,
        "affected": len(affected),
        "longest_request_s": round(max(r.done - r.sent for r in window), 3),
        "mean_ttft_ms": round(statistics.fmean(ttfts), 1) if ttfts else None,
        "p99_ttft_ms": round(statistics.quantiles(ttfts, n=100)[98], 1) if len(ttfts) >= 20 else None,
        "errors": sorted({r.error[:120] for r in window if not r.ok})[:5],
        "failed_statuses": sorted({r.status for r in window if not r.ok}),
    }


async def around(stack, fault, restore=None) -> tuple[dict, str]:
    """Steady load, `fault(leader)` AROUND s in, `restore(leader)` when it returns something to
    wait for, AROUND s more; the figures and the leader at the fault."""
    load = Load(f"http://127.0.0.1:{stack.llm_port}/v1/completions", stack.auth_headers())
    running = asyncio.ensure_future(load.run())
    await wait_for(lambda: sum(r.ok for r in load.sent) >= 20, timeout=30)
    await asyncio.sleep(AROUND)
    leaders = await asyncio.to_thread(acting, stack)
    assert len(leaders) == 1, f"before the fault: acting {leaders}"
    assert await linked(stack), "before the fault: the replicas' link"
    # Envoy's health checks see it too: every stream goes to the leader
    await wait_for(lambda: envoy_routes_to(stack), timeout=5)
    assert await envoy_routes_to(stack) == leaders, "Envoy's healthy picker hosts"
    unrouted = await ext_proc_failed_open(stack)
    fault_at = time.monotonic()
    open_at_fault = [r for r in load.sent if not r.done]
    await asyncio.to_thread(fault, leaders[0])
    end_at = time.monotonic()
    if restore is not None:
        end_at = await restore(leaders[0])
    await asyncio.sleep(AROUND)
    load.stop.set()
    await running
    unrouted = await ext_proc_failed_open(stack) - unrouted
    return figures(load, fault_at, end_at, open_at_fault, unrouted), leaders[0]


async def back_to_two(stack, name: str) -> None:
    """Restart a stopped replica (it comes back warm, as a standby) and wait for one acting."""
    await asyncio.to_thread(stack.restart_process, name)
    await wait_for(lambda: len(acting(stack)) == 1, timeout=30)
    await wait_for(lambda: linked(stack), timeout=10)   # both ways, the survivor to the new process too


def report(record_property, case: str, stack, f: dict) -> None:
    f = {"case": case, "body_mode": stack.config.body_mode, **f}
    print("failover", json.dumps(f))
    record_property("figures", json.dumps(f))   # `python -m bench failover` reads them


@pytest.mark.parametrize("stack", ["full-duplex", "buffered"], indirect=True)
async def test_sigterm_of_the_leader_loses_nothing(stack, record_property):
    def terminate(leader):
        stack.signal_process(leader, signal.SIGTERM, group=False)   # as the kubelet, to PID 1
        stack.proc(leader).popen.wait(timeout=30)
    f, leader = await around(stack, terminate)
    report(record_property, "SIGTERM (rolling update)", stack, f)
    await back_to_two(stack, leader)
    assert f["unrouted"] == 0 and f["failed"] == 0, f


@pytest.mark.parametrize("stack", ["full-duplex", "buffered"], indirect=True)
async def test_sigkill_of_the_leader_fails_only_its_open_streams_at_once(stack, record_property):
    def kill(leader):
        stack.signal_process(leader, signal.SIGKILL)                # the container's whole group
        stack.proc(leader).popen.wait(timeout=30)
    f, leader = await around(stack, kill)
    report(record_property, "SIGKILL (crash)", stack, f)
    standby = next(n for n in ("picker", "picker-1") if n != leader)
    takeovers = await failovers(stack, standby)
    await back_to_two(stack, leader)
    assert f["unrouted"] == 0, f
    assert f["open_at_fault_failed_within_s"] < 1.0, f           # at once, not after a timeout
    assert set(f["failed_statuses"]) <= {503}, f                 # Envoy's statusOnError, retryable
    assert f["degraded_window_s"] < 1.0, f
    assert takeovers.get("leader_gone") == 1, takeovers
    assert f["failed_arriving_after"] == 0, f                    # the standby serves them
    assert f["failed"] == f["open_at_fault_failed"], f           # only streams open at the kill


@pytest.mark.parametrize("stack", ["full-duplex"], indirect=True)
async def test_a_hung_leader_holds_no_request_past_the_message_timeout(stack, record_property):
    def stop(leader):
        stack.signal_process(leader, signal.SIGSTOP)

    async def resume(leader):
        await asyncio.sleep(HANG)
        stack.signal_process(leader, signal.SIGCONT)
        return time.monotonic()
    f, leader = await around(stack, stop, resume)
    report(record_property, f"SIGSTOP {HANG:g} s (hung)", stack, f)
    standby = next(n for n in ("picker", "picker-1") if n != leader)
    takeovers = await failovers(stack, standby)
    await wait_for(lambda: len(acting(stack)) == 1, timeout=30)
    assert takeovers.get("leader_silent") == 1, takeovers
    assert f["longest_request_s"] < MESSAGE_TIMEOUT and f["unrouted"] == 0, f
    # what the hung replica held is served when it wakes (Envoy keeps the streams open)
    assert f["failed"] == 0, f


@pytest.mark.parametrize("stack", ["full-duplex"], indirect=True)
async def test_the_leader_rides_an_api_server_outage_through(stack, record_property):
    lease_before = await asyncio.to_thread(read_lease, stack.config)

    def stop_api(_leader):
        stack.signal_process("kube-apiserver", signal.SIGSTOP)

    async def resume_api(_leader):
        await asyncio.sleep(OUTAGE)
        stack.signal_process("kube-apiserver", signal.SIGCONT)
        return time.monotonic()
    f, leader = await around(stack, stop_api, resume_api)
    report(record_property, f"API server stopped {OUTAGE:g} s", stack, f)
    assert await asyncio.to_thread(acting, stack) == [leader]     # the same one throughout
    await wait_for(lambda: (read_lease(stack.config) or {}).get("holder") == leader, timeout=10)
    assert read_lease(stack.config)["transitions"] == lease_before["transitions"]
    assert f["failed"] == 0 and f["unrouted"] == 0, f
