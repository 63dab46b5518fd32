"""Through the real Envoy, on a live stack (3 simulated groups, the picker, Envoy Gateway + Envoy),
in both request-body modes of the EnvoyExtensionPolicy: completions and chat, streaming and not,
on both listeners; 8081 requests land where the picker said (Envoy's own per-host counters); the
400 / 404 / 413 / 429 paths."""

from __future__ import annotations

import asyncio
import uuid
import zlib

import aiohttp
import numpy as np
import pytest

from loadtest.prompts import random_words
from tests.e2e.conftest import (chat, completion, envoy_upstream_requests, picker_decisions, read_sse,
                                scrape, start_stack, successes, wait_for)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("routing"), f"routing-{request.param}", body_mode=request.param)
    yield s
    s.stop()


def url(stack, listener: str, path: str) -> str:
    port = stack.http_port if listener == "http" else stack.llm_port
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
    if api == "chat":  # vLLM opens a chat stream with the role alone, before any token
        opener, tokens = tokens[0], tokens[1:]
        assert opener["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(tokens) == 12  # one chunk per decoded token, none lost or merged
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"


async def test_each_llm_request_goes_where_the_picker_said(stack, session):
    """One request at a time: the only upstream host whose Envoy counter moved is the endpoint
    of the picker's newest decision."""
    sims = [s.address for s in stack.topology.sims]
    for i in range(9):
        before, decided = await envoy_upstream_requests(session, stack), len(picker_decisions(stack))
        body = completion(prompt=f"single {i} " * (30 + 40 * i), max_tokens=2 + i, stream=i % 2 == 0)
        async with session.post(url(stack, "llm-gw", "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        after = await envoy_upstream_requests(session, stack)
        decisions = await wait_for(lambda: d if len(d := picker_decisions(stack)) > decided else None)
        assert len(decisions) == decided + 1
        moved = [a for a in sims if after.get(a, 0) != before.get(a, 0)]
        assert moved == [decisions[-1]] and after[moved[0]] == before.get(moved[0], 0) + 1


async def test_concurrent_llm_requests_land_on_the_endpoints_the_picker_chose(stack, session):
    """24 concurrent requests: per endpoint, the picker's decisions, Envoy's upstream requests and
    the simulator's own completed requests are the same numbers."""
    sims = [s.address for s in stack.topology.sims]
    before_sims = {a: await successes(session, a) for a in sims}
    before_envoy, decided = await envoy_upstream_requests(session, stack), len(picker_decisions(stack))

    async def one(i: int) -> None:
        body = completion(prompt=f"question {i} " * (20 + 7 * i), max_tokens=3 + i % 5, stream=i % 2 == 0)
        async with session.post(url(stack, "llm-gw", "/v1/completions"), json=body,
                                headers={"x-request-id": f"client-{uuid.uuid4()}"}) as r:
            assert r.status == 200
            await r.read()

    await asyncio.gather(*(one(i) for i in range(24)))
    after_envoy = await envoy_upstream_requests(session, stack)
    after_sims = {a: await successes(session, a) for a in sims}
    decisions = await wait_for(lambda: d if len(d := picker_decisions(stack)) >= decided + 24 else None)
    picked = decisions[decided:]
    assert len(picked) == 24
    for a in sims:
        assert picked.count(a) == after_envoy.get(a, 0) - before_envoy.get(a, 0) == after_sims[a] - before_sims[a]
    assert len(set(picked)) > 1  # the load spread, so the equality above is not trivially one host


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

    def distinct_prompt(tag: str) -> str:
        """3,500 tokens (workload words are one token each in the simulators' tokenizer) with no
        shared prefix: the prefix cache must not help."""
        return random_words(np.random.default_rng(zlib.crc32(tag.encode())), 3500)

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


def test_a_second_stack_fails_fast_and_leaves_the_first_serving(stack, tmp_path):
    from local.stack import Stack, StackConfig, StackError

    second = Stack(StackConfig(name="second", run_root=tmp_path, groups=1))
    with pytest.raises(StackError, match="another Envoy Gateway or Envoy runs"):
        second.start()
    assert second.procs == []
    import urllib.request
    request = urllib.request.Request(url(stack, "http", "/v1/models"), headers=stack.auth_headers())
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_a_body_over_the_limits_gets_413(stack, session, listener):
    """Buffered: Envoy's own buffer (ClientTrafficPolicy bufferLimit 2Mi) answers 413 on 8081;
    full-duplex: the body streams to the picker, whose --max-body-bytes (8 MiB) answers 413 with
    its JSON error. 8080 does not buffer and passes the body on to vLLM, which refuses it (400)."""
    body = completion(prompt="word " * (9 * 1024 * 1024 // 5))
    async with session.post(url(stack, listener, "/v1/completions"), json=body) as r:
        text = await r.text()
        if listener == "http":
            assert r.status == 400, text
        else:
            assert r.status == 413, text
            if stack.topology.body_mode == "full-duplex":
                assert "error" in (await r.json())
