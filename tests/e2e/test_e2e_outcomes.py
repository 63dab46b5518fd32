"""Outcomes through the real Envoy (base/gateway/envoy-proxy.yaml: Envoy's gRPC access log to the
picker's --outcomes-port; token-accounting.lua): for requests in both body modes, completions and
chat, streamed and not, served and refused by the upstream, the picker receives one outcome each,
naming the endpoint it chose, the token counts the client got in `usage`, the status, and for
streamed answers a first-token time no later than the client's own. Envoy flushes its access log
buffer every second (its default; Envoy Gateway does not expose it), so outcomes lag the responses
by up to about a second; the test waits for them, no longer."""

from __future__ import annotations

import json
import time

import aiohttp
import pytest

from tests.e2e.conftest import chat, completion, json_lines, picker_decisions, scrape, start_stack, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["full-duplex", "buffered"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp(f"outcomes-{request.param}"), f"outcomes-{request.param}",
                    groups=2, body_mode=request.param)
    yield s
    s.stop()


def picker_outcomes(stack) -> dict[str, dict]:
    """request id -> the outcome the picker logged (debug), from its own log."""
    return {r["request_id"]: r for r in json_lines(stack.proc("picker").log) if r.get("msg") == "outcome"}


def picker_inflight_ids(stack) -> list[str]:
    return [r["inflight_id"] for r in json_lines(stack.proc("picker").log) if r.get("msg") == "decision"]


REQUESTS = [
    ("/v1/completions", completion(prompt="outcome test " * 30, max_tokens=7)),
    ("/v1/completions", completion(prompt="outcome stream " * 30, max_tokens=9, stream=True)),
    ("/v1/chat/completions", chat(content="outcome chat " * 30, max_tokens=5)),
    ("/v1/chat/completions", chat(content="outcome chat stream " * 30, max_tokens=6, stream=True)),
    ("/v1/completions", completion(prompt="too long an answer", max_tokens=10 ** 7)),  # the engine's 400
]


async def send(session, url: str, body: dict) -> dict:
    started, first, usage = time.monotonic(), None, None
    async with session.post(url, json=body) as r:
        status = r.status
        if body.get("stream") and status == 200:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    first = first or (time.monotonic() if event.get("choices") else None)
                    usage = event.get("usage") or usage
        else:
            usage = (await r.json()).get("usage")
    return {"status": status, "usage": usage, "ttft": first and first - started}


async def test_every_request_comes_back_as_its_outcome(stack, session):
    url = f"http://127.0.0.1:{stack.llm_port}"
    metrics = f"http://127.0.0.1:{stack.config.picker_metrics_port}/metrics"
    seen, decided = [], []
    for path, body in REQUESTS:  # one at a time: the picker's newest decision is this request's
        before = len(picker_decisions(stack))
        seen.append(await send(session, url + path, body))
        await wait_for(lambda: len(picker_decisions(stack)) > before)
        decided.append((picker_inflight_ids(stack)[-1], picker_decisions(stack)[-1]))
    assert [s["status"] for s in seen] == [200, 200, 200, 200, 400]
    outcomes = await wait_for(lambda: o if all(i in (o := picker_outcomes(stack)) for i, _ in decided)
                              else None, timeout=10)
    for (request_id, endpoint), client in zip(decided, seen):
        o = outcomes[request_id]
        assert (o["endpoint"], o["status"], o["model"], o["client"]) == (endpoint, client["status"], "qwq",
                                                                         "loadtest"), o
        usage = client["usage"] or {}
        assert (o["prompt_tokens"], o["completion_tokens"]) == (usage.get("prompt_tokens"),
                                                                usage.get("completion_tokens")), (o, usage)
        if client["ttft"] is not None:
            assert 0 < o["ttft"] <= client["ttft"] and o["ttft"] <= o["duration"], (o, client)
        else:
            assert o["ttft"] is None
        assert 0 <= o["lag"] < 3.0, o
    async with aiohttp.ClientSession() as plain:
        rows = await scrape(plain, metrics)
    counted = {labels: v for name, labels, v in rows if name == "picker_outcomes_total"}
    assert sum(v for labels, v in counted.items() if 'decision="replica"' in labels) >= len(REQUESTS)
    assert sum(v for labels, v in counted.items() if 'status="400"' in labels) >= 1
    assert sum(v for labels, v in counted.items() if 'decision="none"' in labels) == 0
