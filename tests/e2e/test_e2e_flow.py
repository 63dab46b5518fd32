"""Flow control through the real Envoy, in both request-body modes: a request no engine can start
now is held in the picker (Envoy waits for the ext_proc answer) and dispatched once a scrape
shows room; a client that disconnects while held leaves the queue at once; a full queue and the
age bound answer 503/429 with an OpenAI-style body naming the reason; priorities order the
queue; a picker stopped (SIGTERM) while holding requests sends them all on, and one killed
gives every held client a prompt 503 from Envoy.

Room is made scarce on purpose: 2 simulated groups, each running one request at a time
(--max-num-seqs 1), and long `filler` requests, so an engine's waiting queue is non-empty
while they run."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import aiohttp
import pytest

from tests.e2e.conftest import completion, json_lines, scrape, start_stack, wait_for

pytestmark = pytest.mark.e2e

MAX_WAIT = 8.0            # --flow-max-wait (s); the gateway's messageTimeout is above it
MAX_WAIT_SHEDDABLE = 1.0  # --flow-max-wait-sheddable
FILLER_TOKENS = 3000      # ~3 s per filler at the e2e speedup (100x)


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("flow"), f"flow-{request.param}", groups=2,
                    body_mode=request.param, scrape_interval=0.05,
                    sim_args=["--max-num-seqs", "1"],
                    picker_args_extra=["--flow-control", "--flow-max-wait", str(MAX_WAIT),
                                       "--flow-max-wait-sheddable", str(MAX_WAIT_SHEDDABLE),
                                       "--flow-max-requests", "3"])
    yield s
    s.stop()


def llm(stack) -> str:
    return f"http://127.0.0.1:{stack.llm_port}/v1/completions"


def metrics_url(stack) -> str:
    return f"http://127.0.0.1:{stack.config.picker_metrics_port}/metrics"


async def picker_metric(session, stack, name: str, **labels) -> float:
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for metric, label_text, value in await scrape(session, metrics_url(stack)):
        if metric == name and want <= set(label_text.strip("{}").split(",")):
            total += value
    return total


async def queued(session, stack) -> float:
    return await picker_metric(session, stack, "picker_flow_queued_requests")


async def post(session, stack, body: dict, objective: str | None = None, tag: str = "",
               timeout: float | None = None, client: str | None = None) -> tuple[int, dict, float]:
    headers = {"x-request-id": f"{tag or 'flow'}-{uuid.uuid4()}"}
    if client:  # another API key: the edge sets x-client-id from it
        headers.update(stack.auth_headers(client))
    if objective:
        headers["x-gateway-inference-objective"] = objective
    started = time.monotonic()
    options = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
    async with session.post(llm(stack), json=body, headers=headers, **options) as r:
        data = await r.json(content_type=None)
        return r.status, data, time.monotonic() - started


def filler(i: int) -> dict:
    return completion(prompt=f"filler {i} " * 50, max_tokens=FILLER_TOKENS, ignore_eos=True)


async def fill(session, stack) -> list[asyncio.Future]:
    """Long requests until every engine has one running and one waiting (no room anywhere)."""
    tasks = []
    for i in range(4):
        tasks.append(asyncio.ensure_future(post(session, stack, filler(i), tag="filler")))
        await asyncio.sleep(0.15)  # a scrape between two sends: the picker sees each one

    async def saturated():
        rows = await scrape(session, metrics_url(stack))
        waiting = [v for name, _, v in rows if name == "picker_endpoint_queue"]
        return len(waiting) == 2 and all(w >= 1 for w in waiting)
    await wait_for(saturated, timeout=10)
    return tasks


async def drain(tasks) -> None:
    for status, data, _ in await asyncio.gather(*tasks):
        assert status == 200, data


async def test_held_until_room_then_dispatched(stack, session):
    fillers = await fill(session, stack)
    dispatched_before = await picker_metric(session, stack, "picker_flow_queue_wait_seconds_count")
    probe = asyncio.ensure_future(post(session, stack, completion(max_tokens=4), tag="probe"))
    await wait_for(lambda: queued(session, stack), timeout=5)  # held in the picker, not an engine
    assert not probe.done()
    status, data, seconds = await asyncio.wait_for(probe, 30)
    assert status == 200, data
    assert data["usage"]["completion_tokens"] == 4
    assert await queued(session, stack) == 0
    assert await picker_metric(session, stack, "picker_flow_queue_wait_seconds_count") \
        == dispatched_before + 1
    await drain(fillers)


async def test_disconnect_while_held_leaves_the_queue_at_once(stack, session):
    fillers = await fill(session, stack)
    cancelled_before = await picker_metric(session, stack, "picker_flow_evictions_total",
                                           reason="cancelled")
    probe = asyncio.ensure_future(post(session, stack, completion(max_tokens=4), tag="gone"))
    await wait_for(lambda: queued(session, stack), timeout=5)
    probe.cancel()  # the client closes its connection
    gone_at = time.monotonic()

    async def left():
        return await queued(session, stack) == 0
    await wait_for(left, timeout=2, interval=0.02)
    assert time.monotonic() - gone_at < 1.0, "the held request outlived its client"
    assert await picker_metric(session, stack, "picker_flow_evictions_total", reason="cancelled") \
        == cancelled_before + 1
    await drain(fillers)


async def test_overflow_and_age_bound_answer_with_the_reason(stack, session):
    fillers = await fill(session, stack)
    # sheddable: held at most MAX_WAIT_SHEDDABLE, then 429 queue_timeout
    status, data, seconds = await post(session, stack, completion(), objective="batch")
    assert status == 429, data
    assert data["error"]["code"] == "queue_timeout" and "queue" in data["error"]["message"]
    assert MAX_WAIT_SHEDDABLE * 0.9 <= seconds < MAX_WAIT
    # the queue holds 3: the 4th normal request is refused at once with 503 queue_full
    held = [asyncio.ensure_future(post(session, stack, completion(max_tokens=2), tag="held"))
            for _ in range(3)]

    async def three():
        return await queued(session, stack) == 3
    await wait_for(three, timeout=5)
    status, data, seconds = await post(session, stack, completion())
    assert status == 503 and data["error"]["code"] == "queue_full", data
    assert data["error"]["type"] == "service_unavailable_error"
    for status, data, _ in await asyncio.gather(*held):
        assert status in (200, 503), data
        if status == 503:
            assert data["error"]["code"] == "queue_timeout"
    await drain(fillers)


async def hold(session, stack, n: int, tag: str) -> list[asyncio.Future]:
    """n short requests, sent while the engines are full, once all n wait in the picker."""
    held = [asyncio.ensure_future(post(session, stack, completion(max_tokens=2), tag=tag))
            for _ in range(n)]

    async def all_queued():
        return await queued(session, stack) == n
    await wait_for(all_queued, timeout=5)
    return held


async def test_higher_priority_is_dispatched_first(stack, session):
    fillers = await fill(session, stack)
    normal = await hold(session, stack, 2, "normal")
    urgent = asyncio.ensure_future(post(session, stack, completion(max_tokens=2),
                                        objective="interactive", tag="urgent"))
    await wait_for(lambda: picker_metric(session, stack, "picker_flow_queued_requests",
                                         priority="10"), timeout=5)
    results = await asyncio.gather(urgent, *normal)
    assert all(status == 200 for status, _, _ in results), results
    # the last three decisions are these three (Envoy replaces the client's x-request-id, so they
    # are told apart by their objective)
    last = [r.get("objective") for r in json_lines(stack.proc("picker").log)
            if r.get("msg") == "decision"][-3:]
    assert last == ["interactive", None, None], last
    await drain(fillers)


async def test_a_heavy_client_does_not_delay_a_light_one(stack, session):
    """Two API keys (the edge's x-client-id): the light client's one request, queued behind two
    of the heavy client's, is dispatched second (round robin per client), not third."""
    fillers = await fill(session, stack)
    heavy = [asyncio.ensure_future(post(session, stack, completion(max_tokens=2), tag="heavy"))
             for _ in range(2)]
    await wait_for(lambda: queued_at_least(session, stack, 2), timeout=5)
    light = asyncio.ensure_future(post(session, stack, completion(max_tokens=2), tag="light",
                                       client="user"))
    await wait_for(lambda: queued_at_least(session, stack, 3), timeout=5)  # the queue's bound here
    results = await asyncio.gather(light, *heavy)
    assert all(status == 200 for status, _, _ in results), results
    clients = [r.get("client") for r in json_lines(stack.proc("picker").log)
               if r.get("msg") == "decision"][-3:]
    assert sorted(clients) == ["loadtest", "loadtest", "user"], clients
    assert clients.index("user") <= 1, clients
    await drain(fillers)


async def queued_at_least(session, stack, n: int) -> bool:
    return await queued(session, stack) >= n


async def test_picker_stopped_while_holding_sends_every_held_request_on(stack, session):
    """SIGTERM (a rolling update, a drain): the held requests are served, and so are the
    requests already running on the engines, whose ext_proc streams Envoy keeps open until their
    responses end. Restarts the picker."""
    fillers = await fill(session, stack)
    held = await hold(session, stack, 3, "handed-on")
    stack.kill_process("picker", signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*held), 30)
    for status, data, _ in results:
        assert status == 200, (status, data)
        assert data["choices"][0]["text"], data
    await drain(fillers)  # each one runs for seconds after the picker has gone
    stack.restart_process("picker")


async def test_picker_killed_while_holding_gives_a_prompt_503(stack, session):
    """Run last in the module: it kills and restarts the picker."""
    fillers = await fill(session, stack)
    held = await hold(session, stack, 3, "orphan")
    killed_at = time.monotonic()
    stack.kill_process("picker")
    results = await asyncio.wait_for(asyncio.gather(*held), 10)
    waited = [time.monotonic() - killed_at]
    for status, data, seconds in results:
        assert status == 503, (status, data)  # the EnvoyExtensionPolicy's statusOnError
    # every held client answered well inside the gateway's messageTimeout: Envoy saw the reset
    assert waited[0] < 2.0, f"held clients answered {waited[0]:.2f}s after the kill"
    print(f"\npicker killed with 3 held requests: all answered 503 within {waited[0] * 1000:.0f} ms")
    stack.restart_process("picker")
    running = await asyncio.gather(*fillers, return_exceptions=True)
    # what a crash costs beyond the held requests: the ones running on the engines, whose
    # streams Envoy kept open (picker/README.md "A replica lost")
    print("requests running on the engines at the kill:",
          [r[0] if isinstance(r, tuple) else type(r).__name__ for r in running])
