"""The Gateway's edge (components/edge-security, rendered by the local stack with throw-away keys)
through the real Envoy: API keys on both listeners, checked before the picker runs; the official
OpenAI client with its api_key; per-client rate limits that refuse before the picker counts the
request, with the load generators' own bucket; client-sent endpoint headers that choose nothing;
the connection limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import openai
import pytest
import yaml

from loadtest.openai_api import error_reason
from local.stack.config import API_CLIENTS
from tests.e2e.conftest import completion, envoy_stats, envoy_upstream_requests, picker_decisions, start_stack, wait_for

pytestmark = pytest.mark.e2e

ENDPOINT_HEADERS = ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-subset")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("edge"), "edge")
    yield s
    s.stop()


def url(stack, listener: str, path: str = "/v1/completions") -> str:
    port = stack.http_port if listener == "http" else stack.llm_port
    return f"http://127.0.0.1:{port}{path}"


def edge_policy(stack, kind: str, name: str) -> dict:
    """The object as the stack rendered it (what a cluster would apply)."""
    return next(d for d in stack.topology.gateway if d["kind"] == kind and d["metadata"]["name"] == name)


def rate_limit(stack, route: str, client: str) -> int:
    """Requests per minute the rendered BackendTrafficPolicy of `route` allows `client`."""
    rules = edge_policy(stack, "BackendTrafficPolicy", route)["spec"]["rateLimit"]["local"]["rules"]
    for rule in rules:
        headers = rule["clientSelectors"][0]["headers"]
        exact = [h for h in headers if h["type"] == "Exact"]
        if all((h["value"] == client) != h.get("invert", False) for h in exact):
            assert rule["limit"]["unit"] == "Minute"
            return rule["limit"]["requests"]
    raise AssertionError(f"no rate limit rule for client {client!r} on {route}")


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_requests_without_a_valid_key_are_401_and_never_reach_the_picker(stack, session, listener):
    decisions = len(picker_decisions(stack))
    body = completion()
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer not-a-key"},
                    {"Authorization": f"Bearer {stack.api_key('user')}x"}, {"Authorization": "", "x-api-key": "not-a-key"}):
        async with session.post(url(stack, listener), json=body, headers=headers) as r:
            assert r.status == 401, (headers, r.status, await r.text())
    async with session.post(url(stack, listener), json=body,
                            headers={"Authorization": "", "x-api-key": stack.api_key("user")}) as r:
        assert r.status == 200, await r.text()  # the other place a key may come from
    expected = decisions + (1 if listener == "llm-gw" else 0)  # only the accepted request was routed
    await wait_for(lambda: len(picker_decisions(stack)) >= expected)
    await asyncio.sleep(0.3)
    assert len(picker_decisions(stack)) == expected


def test_the_keys_live_only_in_the_run_folder_and_the_secret(stack):
    """The keys exist only in the run folder (mode 600) and in the Secret handed to Envoy Gateway."""
    path = stack.config.api_keys_file
    assert path.stat().st_mode & 0o777 == 0o600
    assert set(json.loads(path.read_text())) == set(API_CLIENTS)
    resources = (stack.layout.resources / "gateway.yaml").read_text()
    secret = next(d for d in yaml.safe_load_all(resources) if d and d["kind"] == "Secret")
    ref = edge_policy(stack, "SecurityPolicy", "inference-gateway-api-keys")["spec"]["apiKeyAuth"]["credentialRefs"][0]
    assert secret["metadata"] == {"name": ref["name"], "namespace": "llm"}
    assert set(secret["data"]) == set(API_CLIENTS)


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
def test_the_official_openai_client_works_with_its_api_key(stack, listener):
    client = openai.OpenAI(base_url=url(stack, listener, "/v1"), api_key=stack.api_key("user"), max_retries=0)
    chat = client.chat.completions.create(model="qwq", messages=[{"role": "user", "content": "Say hello"}],
                                          max_tokens=4)
    assert chat.model == "qwq" and chat.usage.completion_tokens == 4 and chat.choices[0].message.content
    chunks = list(client.completions.create(model="qwq", prompt="Say hello", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 3
    assert "qwq" in [m.id for m in client.models.list().data]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url(stack, listener, "/v1"), api_key="not-a-key", max_retries=0).models.list()


async def burst(session, stack, listener: str, key: str, count: int) -> list[tuple[int, dict, bytes]]:
    """`count` small requests at once with `key`: (status, response headers, body) of each."""
    async def one(i: int):
        async with session.post(url(stack, listener), json=completion(prompt=f"limit {i}", max_tokens=1),
                                headers={"Authorization": f"Bearer {key}"}) as r:
            body = await r.read()
            return r.status, {k.lower(): v for k, v in r.headers.items()}, body
    return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.parametrize("listener, route", [("http", "reasoning-backend"), ("llm-gw", "reasoning-inference")])
async def test_a_client_over_its_rate_limit_gets_429_before_the_picker_counts_it(stack, session, listener, route):
    limit = rate_limit(stack, route, "user")
    limited_before = (await envoy_stats(session, stack, "http_local_rate_limiter")).get(
        "http_local_rate_limiter.http_local_rate_limit.rate_limited", 0)
    decisions = len(picker_decisions(stack))
    upstream = sum((await envoy_upstream_requests(session, stack)).values())
    # the bucket refills `limit` tokens a minute: within one minute at most 2 x limit pass
    results = await burst(session, stack, listener, stack.api_key("user"), limit + 20)
    codes = [status for status, _, _ in results]
    assert set(codes) <= {200, 429}, codes
    refused = [headers for status, headers, _ in results if status == 429]
    assert refused and len(codes) - len(refused) <= limit
    assert all(h.get("x-ratelimit-limit", "").startswith(str(limit)) for h in refused), refused[0]
    # what a load test reports for each of them
    assert {error_reason(status, body) for status, _, body in results if status == 429} == {
        "HTTP 429: local_rate_limited"}
    stats = await envoy_stats(session, stack, "http_local_rate_limiter")
    assert stats["http_local_rate_limiter.http_local_rate_limit.rate_limited"] - limited_before == len(refused)
    # only the admitted requests reached a backend, and (8081) only they were routed by the picker
    served = codes.count(200)
    await wait_for(lambda: _sum_upstream(session, stack, upstream + served))
    if listener == "llm-gw":
        await asyncio.sleep(0.3)
        assert len(picker_decisions(stack)) - decisions == served
    # the load generators' key has its own, larger bucket on the same route
    loadtest = await burst(session, stack, listener, stack.api_key("loadtest"), limit + 20)
    assert rate_limit(stack, route, "loadtest") > limit + 20
    assert [s for s, _, _ in loadtest] == [200] * (limit + 20)


async def _sum_upstream(session, stack, at_least: int) -> bool:
    return sum((await envoy_upstream_requests(session, stack)).values()) >= at_least


@pytest.mark.parametrize("listener", ["http", "llm-gw"])
async def test_a_client_cannot_choose_its_backend(stack, session, listener):
    """Every request names one simulator; they still spread, and on 8081 each lands where the picker
    said. The running Envoy removes the headers at the edge, before any filter."""
    target = stack.topology.sims[0].address
    headers = {h: target for h in ENDPOINT_HEADERS}
    before = await envoy_upstream_requests(session, stack)
    decisions = len(picker_decisions(stack))

    async def one(i: int):
        body = completion(prompt=f"choose {i} " + "x " * (i * 7 % 50), max_tokens=2)
        async with session.post(url(stack, listener), json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    await asyncio.gather(*(one(i) for i in range(30)))
    after = await envoy_upstream_requests(session, stack)
    landed = {a: after.get(a, 0) - before.get(a, 0) for a in after}
    assert sum(landed.values()) == 30
    assert landed[target] < 30, landed
    if listener == "llm-gw":
        chosen = picker_decisions(stack)[decisions:]
        assert {a: chosen.count(a) for a in landed if chosen.count(a)} == {a: n for a, n in landed.items() if n}
    with urllib.request.urlopen(f"{stack.envoy_admin()}/config_dump?resource=dynamic_listeners") as r:
        dump = json.dumps(json.load(r))
    for header in ENDPOINT_HEADERS:
        assert dump.count(f'"{header}"') >= 2, f"{header} is not removed on both listeners"


def test_connections_beyond_the_limit_are_closed(stack):
    ctp = edge_policy(stack, "ClientTrafficPolicy", "inference-gateway-client")
    limit = ctp["spec"]["connection"]["connectionLimit"]["value"]
    held = []
    try:
        for _ in range(limit):
            held.append(socket.create_connection(("127.0.0.1", stack.http_port)))
        time.sleep(1.0)  # Envoy has accepted them all
        extra = socket.create_connection(("127.0.0.1", stack.http_port))
        extra.settimeout(10)
        started = time.monotonic()
        assert extra.recv(1) == b""  # closed by Envoy (after the policy's closeDelay)
        assert time.monotonic() - started < 8
        extra.close()
        # the held ones still serve (one of them, a whole request)
        conn = held[0]
        key = stack.api_key("loadtest")
        conn.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
        conn.settimeout(10)
        assert conn.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
