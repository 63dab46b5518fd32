"""Dead and stalled backends through the real Envoy, with components/healthy-backends as
overlays/a10 renders it (active /health checks every 3 s, outlier detection, retries only before a backend
saw the request): on 8080 (Envoy's own least request) a killed group costs at most a handful of
failed requests and none once the health checks have taken it out; a stalled group (SIGSTOP: it
accepts connections and never answers) is out within TAKEN_OUT seconds. 8081 is measured the same way.
The figures are printed (pytest -s). Each case takes ~30 s: the load runs until 40 requests were sent
after the group is out (TAKEN_OUT, set by the rendered health check's 3 s interval), and the next
case waits until the health checks and the picker have the group back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import pytest

from tests.e2e.conftest import LOAD_RATE, envoy_stats, scrape, start_stack, stream_load, wait_for

pytestmark = pytest.mark.e2e

# s: a stall just after a passed check fails the next two (3 s interval, 2 s timeout each): out
# after ~10-13 s; requests sent before that wait on the stalled host (the client gives up at 5 s)
TAKEN_OUT = 15.0
HANDFUL = 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("dead"), "dead-backend", body_mode="full-duplex",
                    scrape_interval=0.5)
    yield s
    s.stop()


def url(stack, listener: str) -> str:
    port = stack.http_port if listener == "http" else stack.llm_port
    return f"http://127.0.0.1:{port}/v1/completions"


async def run_fault(stack, session, listener: str, fault) -> dict:
    victim = stack.topology.sims[0]
    results: list = []
    statuses: Counter = Counter()
    stop = asyncio.Event()
    tasks = stream_load(session, url(stack, listener), stop, results, request_id="dead", timeout=5,
                        statuses=statuses)
    await wait_for(lambda: sum(ok for _, ok, _ in results) >= 12, timeout=30)
    await health_checks_on_their_interval(stack, session, victim.address)
    at = time.time()
    fault(victim)
    await wait_for(lambda: sum(1 for sent, _, _ in results if sent > at + TAKEN_OUT) >= 40, timeout=60)
    stop.set()
    await asyncio.gather(*tasks)
    after = [r for r in results if r[0] >= at]
    failed = [sent - at for sent, ok, _ in after if not ok]
    late = [ok for sent, ok, _ in after if sent > at + TAKEN_OUT]
    figures = {"fault": fault.__name__, "listener": listener, "requests_after_fault": len(after), "failed": len(failed),
               "last_failure_s": round(max(failed), 2) if failed else None,
               "late_requests": len(late), "late_failed": late.count(False), "statuses": dict(statuses), "load_rate": LOAD_RATE}
    print("dead-backend", fault.__name__, figures)
    assert 429 not in statuses, f"the edge's rate limit answered, not the backends: {figures}"
    return figures


async def health_checks_on_their_interval(stack, session, address: str) -> None:
    """Wait until every Envoy cluster that has the victim ran a health check since traffic began.
    Envoy checks a cluster that has never had traffic every 60 s (no_traffic_interval, which Envoy
    Gateway does not expose), and the check armed before the first request keeps that interval:
    in the first minute after Envoy starts a stalled host would be taken out only by that check,
    not within TAKEN_OUT. Once a check ran with traffic flowing, the next follow every 3 s."""
    async with session.get(f"{stack.envoy_admin()}/clusters?format=json") as r:
        data = await r.json()
    names = [c["name"] for c in data.get("cluster_statuses", [])
             if any(f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}"
                    == address for h in c.get("host_statuses", []))]
    assert names, f"no Envoy cluster has {address}"

    async def attempts() -> dict[str, int]:
        stats = await envoy_stats(session, stack, "cluster.")
        return {n: stats.get(f"cluster.{n}.health_check.attempt", 0) for n in names}

    start = await attempts()

    async def every_cluster_checked() -> bool:
        now = await attempts()
        return all(now[n] > start[n] for n in names)
    await wait_for(every_cluster_checked, timeout=70, interval=0.5)


def kill(stack):
    def killed(victim):
        stack.kill_process(f"sim-{victim.port}")
    return killed


def stall(stack):
    def stalled(victim):
        os.killpg(stack.proc(f"sim-{victim.port}").pid, signal.SIGSTOP)
    return stalled


async def restore(stack, session, victim, stalled: bool):
    """The group serves again, and the next test starts only once Envoy's health checks and the
    picker both have it back (not after a guessed sleep)."""
    if stalled:
        os.killpg(stack.proc(f"sim-{victim.port}").pid, signal.SIGCONT)
    else:
        stack.restart_process(f"sim-{victim.port}")
    await wait_for(lambda: back_in_service(stack, session, victim.address), timeout=4 * TAKEN_OUT, interval=0.2)


async def back_in_service(stack, session, address: str) -> bool:
    """Every Envoy cluster that has the host counts it healthy (no failed active health check, no
    outlier ejection) and the picker counts it ready."""
    async with session.get(f"{stack.envoy_admin()}/clusters?format=json") as r:
        data = await r.json()
    flags = [host.get("health_status", {}) for cluster in data.get("cluster_statuses", [])
             for host in cluster.get("host_statuses", [])
             if f"{host['address']['socket_address']['address']}:{host['address']['socket_address']['port_value']}" == address]
    envoy_ok = bool(flags) and all(f.get("eds_health_status", "HEALTHY") == "HEALTHY" and
                                   not any(v is True for k, v in f.items() if k != "eds_health_status") for f in flags)
    metrics = f"http://{stack.config.host}:{stack.config.picker_metrics_port}/metrics"
    ready = [value for name, labels, value in await scrape(session, metrics)
             if name == "picker_endpoint_ready" and f'endpoint="{address}"' in labels]
    return envoy_ok and ready == [1.0]


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_killed_group_costs_a_handful_of_requests(stack, session, listener, record_property):
    figures = await run_fault(stack, session, listener, kill(stack))
    record_property("figures", json.dumps(figures))  # `python -m bench dead-backend` reads them
    await restore(stack, session, stack.topology.sims[0], stalled=False)
    assert figures["failed"] <= HANDFUL, figures
    assert figures["late_requests"] >= 40 and figures["late_failed"] == 0, figures


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_stalled_group_is_taken_out_within_seconds(stack, session, listener, record_property):
    figures = await run_fault(stack, session, listener, stall(stack))
    record_property("figures", json.dumps(figures))
    await restore(stack, session, stack.topology.sims[0], stalled=True)
    assert figures["late_requests"] >= 40 and figures["late_failed"] == 0, figures
