"""Failures on a live stack with the real Envoy, in both request-body modes: a simulator killed
mid-run, every simulator down (503 from the picker), the picker stopped (FailClose: 503 on 8081,
8080 serves)."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest

from tests.e2e.conftest import completion, json_lines, start_stack, stream_load, wait_for

pytestmark = pytest.mark.e2e

SCRAPE = 0.5  # picker scrape interval here; the bound below is two of them


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("failures"), f"failures-{request.param}", body_mode=request.param,
                    scrape_interval=SCRAPE)
    yield s
    s.stop()


def llm(stack, path="/v1/completions"):
    return f"http://127.0.0.1:{stack.llm_port}{path}"


def http(stack, path="/v1/completions"):
    return f"http://127.0.0.1:{stack.http_port}{path}"


async def llm_serves_again(stack, session, timeout: float) -> None:
    """Wait until a completion through 8081 answers 200 again."""
    async def served():
        async with session.post(llm(stack), json=completion()) as r:
            return r.status == 200
    await wait_for(served, timeout=timeout)


def decision_times(stack, endpoint: str) -> list[float]:
    out = []
    for r in json_lines(stack.proc("picker").log):
        if r.get("msg") == "decision" and r.get("endpoint") == endpoint:
            ts = datetime.datetime.strptime(r["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
            out.append(ts.replace(tzinfo=datetime.timezone.utc).timestamp())
    return out


async def test_killed_simulator_is_dropped_within_two_scrape_intervals(stack, session):
    victim = stack.topology.sims[0]
    results: list[tuple[float, bool, float]] = []
    stop = asyncio.Event()
    workers = stream_load(session, llm(stack), stop, results, max_tokens=8, request_id="kill")
    await wait_for(lambda: len(decision_times(stack, victim.address)) >= 3 and sum(ok for _, ok, _ in results) >= 6,
                   timeout=20)
    killed_at = time.time()
    stack.kill_process(f"sim-{victim.port}")
    bound = killed_at + 2 * SCRAPE
    await wait_for(lambda: sum(1 for sent, _, _ in results if sent > bound) >= 30, timeout=30)
    stop.set()
    await asyncio.gather(*workers)

    last_pick = max(decision_times(stack, victim.address))
    assert last_pick <= bound, f"picker still chose the dead endpoint {last_pick - killed_at:.2f}s after the kill"
    late = [ok for sent, ok, _ in results if sent > bound]
    assert late and all(late), f"{late.count(False)} of {len(late)} late requests failed"
    stack.restart_process(f"sim-{victim.port}")


async def test_no_ready_endpoint_is_503_from_the_picker(stack, session):
    for sim in stack.topology.sims:
        stack.kill_process(f"sim-{sim.port}")

    async def refused():  # until the picker notices, the gateway itself fails to connect (text/plain)
        async with session.post(llm(stack), json=completion()) as r:
            if r.status == 503 and r.content_type == "application/json":
                return (await r.json())["error"]["message"]
            assert r.status == 503
            return None
    assert "no ready endpoint" in await wait_for(refused, timeout=10)
    async with session.post(http(stack), json=completion()) as r:
        assert r.status == 503  # the gateway cannot connect to any leader
    stack.restart_process(*(f"sim-{sim.port}" for sim in stack.topology.sims))
    await llm_serves_again(stack, session, timeout=10)


async def test_picker_stopped_fails_close_while_8080_serves(stack, session):
    stack.stop_process("picker")
    for _ in range(3):
        async with session.post(llm(stack), json=completion()) as r:
            assert r.status == 503  # the policy's statusOnError; Envoy sends it with no body
            assert await r.text() == ""
    for i in range(12):
        async with session.post(http(stack), json=completion(stream=i % 2 == 1)) as r:
            assert r.status == 200
            await r.read()
    # a restarted picker (new self-signed certificate) is picked up again
    stack.restart_process("picker")
    await llm_serves_again(stack, session, timeout=10)


async def test_reset_starts_the_next_run_cold(stack, session):
    """`python -m local.stack reset` restarts the simulators and the picker (empty caches and
    counters, no prefix index) while Envoy keeps serving; 8081 routes again right after."""
    import subprocess
    import sys

    from tests.e2e.conftest import successes

    for i in range(3):
        async with session.post(llm(stack), json=completion(prompt=f"warm-up {i}")) as r:
            assert r.status == 200
    sims = [s.address for s in stack.topology.sims]
    assert sum([await successes(session, a) for a in sims]) >= 3
    cpu_before = stack.cpu_seconds()
    rc = subprocess.call([sys.executable, "-m", "local.stack", "reset", "--name", stack.config.name,
                          "--run-root", str(stack.config.run_root)])
    assert rc == 0
    assert sum([await successes(session, a) for a in sims]) == 0  # new simulator processes
    cpu_after = stack.cpu_seconds()  # the replaced processes' CPU still counts
    assert all(cpu_after[name] >= cpu_before[name] for name in cpu_before), (cpu_before, cpu_after)
    await llm_serves_again(stack, session, timeout=15)
