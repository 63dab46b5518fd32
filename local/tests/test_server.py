"""HTTP simulator: vLLM shapes over a real socket on 127.0.0.1 (in-test server, high speedup)."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from local.sim.engines import TINY
from local.sim.server import Faults, SimServer

ENGINE_MODEL = TINY.with_overrides(num_gpu_blocks=256, max_model_len=512, max_num_batched_tokens=64,
                              max_num_seqs=8)


@pytest.fixture
async def make_client():
    clients = []

    async def factory(faults=None, names=("qwq", "qwq-canary"), seed=0):
        server = SimServer(ENGINE_MODEL, list(names), speedup=1000.0, seed=seed, faults=faults)
        client = TestClient(TestServer(server.make_app(), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client, server

    yield factory
    for c in clients:
        await c.close()


async def sse_events(resp):
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[6:]) for f in frames[:-1]]


async def test_streaming_completion_one_chunk_per_token_and_usage(make_client):
    client, _ = await make_client()
    body = {"model": "qwq", "prompt": "one two three four five", "max_tokens": 7,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    tokens, usage = events[:-1], events[-1]
    assert len(tokens) == 7
    assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in tokens)
    assert all(len(e["choices"][0]["text"].split()) == 1 for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 6 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


async def test_streaming_chat_without_usage_and_role_first(make_client):
    client, _ = await make_client()
    body = {"model": "qwq-canary", "messages": [{"role": "user", "content": "hi there"}],
            "max_completion_tokens": 3, "stream": True, "ignore_eos": True}
    events = await sse_events(await client.post("/v1/chat/completions", json=body))
    assert len(events) == 1 + 3 and all("usage" not in e for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # vLLM's opener
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert events[0]["model"] == "qwq-canary"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_non_streaming_shapes(make_client):
    client, _ = await make_client()
    resp = await client.post("/v1/completions", json={"model": "qwq", "prompt": "a b c",
                                                      "max_tokens": 4, "ignore_eos": True})
    data = await resp.json()
    assert data["object"] == "text_completion"
    assert len(data["choices"][0]["text"].split()) == 4
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    resp = await client.post("/v1/chat/completions", json={
        "model": "qwq", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2,
        "ignore_eos": True})
    data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["usage"]["prompt_tokens"] == 3 + 5 + 3 and data["usage"]["completion_tokens"] == 2


async def test_eos_point_is_deterministic_without_ignore_eos(make_client):
    client, _ = await make_client()
    body = {"model": "qwq", "prompt": "w " * 20, "max_tokens": 400}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    n = first["usage"]["completion_tokens"]
    assert n == second["usage"]["completion_tokens"] and 16 <= n < 400
    assert first["choices"][0]["finish_reason"] == "stop"


async def test_the_answer_ends_at_min_tokens_under_a_larger_cap(make_client):
    # how load tests give a capped request the length they choose (loadtest/openai_api.py)
    client, _ = await make_client()
    for n in (5, 33):
        body = {"model": "qwq", "prompt": "w " * 20, "max_tokens": 400, "min_tokens": n}
        out = await (await client.post("/v1/completions", json=body)).json()
        assert out["usage"]["completion_tokens"] == n
        assert out["choices"][0]["finish_reason"] == "stop"
    over = {"model": "qwq", "prompt": "w " * 20, "max_tokens": 8, "min_tokens": 30}
    resp = await client.post("/v1/completions", json=over)        # refused, as vLLM does
    assert resp.status == 400 and "min_tokens must be less than or equal to max_tokens=8" \
        in (await resp.json())["error"]["message"]


async def test_errors(make_client):
    client, _ = await make_client()
    resp = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert resp.status == 404
    err = (await resp.json())["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404 and "nope" in err["message"]
    resp = await client.post("/v1/completions", data=b"{not json")
    assert resp.status == 400
    resp = await client.post("/v1/completions", json={"model": "qwq", "prompt": "x " * 520,
                                                      "max_tokens": 4})
    assert resp.status == 400 and "maximum context length" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/chat/completions", json={"model": "qwq", "messages": []})
    assert resp.status == 400 and "empty conversation" in (await resp.json())["error"]["message"]


async def test_prompt_plus_max_tokens_over_the_context_is_served_up_to_it(make_client):
    # vLLM 0.32 serves a prompt that fits and stops the output at max_model_len (512 here)
    client, _ = await make_client()
    resp = await client.post("/v1/completions", json={"model": "qwq", "prompt": "x " * 500,
                                                      "max_tokens": 100, "ignore_eos": True})
    data = await resp.json()
    assert resp.status == 200 and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 500, "completion_tokens": 12, "total_tokens": 512}


async def test_models_health_metrics(make_client):
    client, _ = await make_client()
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["qwq", "qwq-canary"]
    assert (await client.get("/health")).status == 200
    await client.post("/v1/completions", json={"model": "qwq", "prompt": "a b", "max_tokens": 2})
    resp = await client.get("/metrics")
    text = await resp.text()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert 'vllm:generation_tokens_total{engine="0",model_name="qwq"} 2.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="qwq"} 0.0' in text


async def test_fault_error_rate_and_metrics_failure(make_client):
    client, _ = await make_client(Faults(error_rate=1.0, metrics_fail=True))
    resp = await client.post("/v1/completions", json={"model": "qwq", "prompt": "a"})
    assert resp.status == 500 and (await resp.json())["error"]["code"] == 500
    assert (await client.get("/metrics")).status == 500
    assert (await client.get("/health")).status == 200


async def test_fault_stall_after_keeps_requests_hanging(make_client):
    client, server = await make_client(Faults(stall_after=1))
    ok = await client.post("/v1/completions", json={"model": "qwq", "prompt": "a", "max_tokens": 2})
    assert ok.status == 200
    # At speedup 1000 a 2-token request takes well under a millisecond unless the engine stalls.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post("/v1/completions", json={
            "model": "qwq", "prompt": "a", "max_tokens": 2}), timeout=1.0)
    text = await (await client.get("/metrics")).text()
    assert "vllm:num_requests_waiting" in text and server.stalled


async def test_client_disconnect_aborts_request(make_client):
    client, server = await make_client()
    body = {"model": "qwq", "prompt": "a b c", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    await resp.content.readline()
    resp.close()
    for _ in range(200):             # polling with a generous bound
        if not server.engine.requests:
            break
        await asyncio.sleep(0.01)
    assert not server.engine.requests and server.engine.request_success.get("abort") == 1
