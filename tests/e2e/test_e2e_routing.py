"""Through the gateway, on a live stack (3 simulated groups, the picker, the gateway), in both
request-body modes: completions and chat, streaming and not, on both ports; 8081 requests land
where the picker said; the 400 / 404 / 429 paths."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from tests.e2e.conftest import (chat, completion, gateway_log, picker_decisions, read_sse, scrape,
                                start_stack, successes, wait_for)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("routing"), f"routing-{request.param}", body_mode=request.param)
    yield s
    s.stop()


def url(stack, listener: str, path: str) -> str:
    port = stack.config.http_port if listener == "http" else stack.config.llm_port
    return f"http://127.0.0.1:{port}{path}"


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_non_streaming(stack, session, listener, api):
    path, body = ("/v1/completions", completion(max_tokens=5)) if api == "completions" \
        else ("/v1/chat/completions", chat(max_tokens=5))
    async with session.post(url(stack, listener, path), json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    assert data["model"] == "qwq"
    assert data["usage"]["completion_tokens"] == 5
    choice = data["choices"][0]
    assert (choice["text"] if api == "completions" else choice["message"]["content"]).strip()
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_streaming(stack, session, listener, api):
    path, body = ("/v1/completions", completion(max_tokens=12, stream=True)) if api == "completions" \
        else ("/v1/chat/completions", chat(max_tokens=12, stream=True))
    async with session.post(url(stack, listener, path), json=body) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    tokens = [e for e in events[:-2] if e["choices"]]
    assert len(tokens) == 12  # one chunk per decoded token, none lost or merged
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"


async def test_llm_requests_land_on_the_endpoint_the_picker_chose(stack, session):
    sims = [s.address for s in stack.topology.sims]
    before = {a: await successes(session, a) for a in sims}

    async def one(i: int) -> tuple[str, str]:
        rid = f"e2e-{uuid.uuid4()}"
        body = completion(prompt=f"question {i} " * (20 + 7 * i), max_tokens=3 + i % 5, stream=i % 2 == 0)
        async with session.post(url(stack, "llm-gw", "/v1/completions"), json=body,
                                headers={"x-request-id": rid}) as r:
            assert r.status == 200
            await r.read()
            return rid, r.headers["x-gateway-served-by"]

    served = dict(await asyncio.gather(*(one(i) for i in range(24))))
    after = {a: await successes(session, a) for a in sims}
    decisions = await wait_for(lambda: (d := picker_decisions(stack)) and all(r in d for r in served) and d)
    logged = {r["request_id"]: r for r in gateway_log(stack) if r["listener"] == "llm-gw"}
    for rid, endpoint in served.items():
        assert decisions[rid] == endpoint  # the picker's own record
        assert logged[rid]["picked"] == logged[rid]["endpoint"] == endpoint
        assert "fallback" not in logged[rid]
    # and the simulators themselves counted exactly those requests
    for a in sims:
        assert after[a] - before[a] == list(served.values()).count(a)


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_bad_request_and_unknown_model(stack, session, listener):
    async with session.post(url(stack, listener, "/v1/completions"), json={"model": "no-such-model", "prompt": "x"}) as r:
        assert r.status == 404
        assert "no-such-model" in (await r.json())["error"]["message"]
    async with session.post(url(stack, listener, "/v1/completions"), json={"model": "qwq", "prompt": "x",
                                                                           "max_tokens": "many"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"]
    async with session.post(url(stack, "llm-gw", "/v1/completions"), data=b"{not json",
                            headers={"content-type": "application/json"}) as r:
        assert r.status == 400


async def test_sheddable_request_is_refused_with_429_when_the_pool_is_saturated(stack, session):
    """Fill every simulator's KV cache directly (not through the gateway), wait until the picker
    sees the pool saturated, then a request with a negative-priority objective gets 429 while an
    interactive one is still placed."""
    metrics = f"http://127.0.0.1:{stack.config.picker_metrics_port}/metrics"

    def distinct_prompt(tag: str) -> str:  # no shared prefix: the prefix cache must not help
        return " ".join(f"w{tag}x{j}" for j in range(3500))

    async with aiohttp.ClientSession() as load:
        flood = [asyncio.ensure_future(load.post(f"http://{s.address}/v1/completions", json=completion(
                     prompt=distinct_prompt(f"{s.port}x{i}"), max_tokens=10000, ignore_eos=True, stream=True)))
                 for s in stack.topology.sims for i in range(14)]

        async def saturated():
            rows = await scrape(session, metrics)
            return any(n == "picker_pool_saturation" and v >= 1.0 for n, _, v in rows)

        try:
            await wait_for(saturated, timeout=20)
            async with session.post(url(stack, "llm-gw", "/v1/completions"), json=completion(),
                                    headers={"x-gateway-inference-objective": "batch"}) as r:
                assert r.status == 429
                assert (await r.json())["error"]["message"]
            async with session.post(url(stack, "llm-gw", "/v1/completions"), json=completion(stream=True),
                                    headers={"x-gateway-inference-objective": "interactive"}) as r:
                assert r.status == 200
        finally:
            for f in flood:
                f.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        for f in flood:
            if f.done() and not f.cancelled() and f.exception() is None:
                f.result().close()  # drop the connection: the simulator aborts the request
    # the pool drains again (aborted requests free their KV blocks)
    async def drained():
        rows = await scrape(session, metrics)
        return any(n == "picker_pool_saturation" and v < 1.0 for n, _, v in rows)
    await wait_for(drained, timeout=30)
