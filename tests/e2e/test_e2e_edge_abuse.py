"""Bad input at the edge through the real Envoy (the local stack renders components/edge-security as
the cluster has it): oversized headers, a header flood, invalid keys at a high rate, keys in the
query string and slow clients (cut at the listeners' header timeout, waited for). Each is refused
early with the right status, and neither the picker nor any simulated vLLM sees it (the picker's
decision log and Envoy's upstream request counts stay as they were). Figures go to `record_property` for `python -m bench edge-abuse`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter

import aiohttp
import pytest

from tests.e2e.conftest import envoy_upstream_requests, picker_decisions, start_stack

pytestmark = pytest.mark.e2e
LISTENERS = ("http", "llm-gw")
BODY = {"model": "qwq", "prompt": "Say hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("abuse"), "abuse", groups=2)
    yield s
    s.stop()


def url(stack, listener: str, query: str = "") -> str:
    return f"http://127.0.0.1:{stack.http_port if listener == 'http' else stack.llm_port}/v1/completions{query}"


async def unseen(stack, session, send) -> Counter:
    """Run `send()` (returns a Counter of statuses); assert nothing reached the picker or a backend."""
    decisions, upstream = len(picker_decisions(stack)), await envoy_upstream_requests(session, stack)
    statuses = await send()
    await asyncio.sleep(0.5)
    assert len(picker_decisions(stack)) == decisions
    assert await envoy_upstream_requests(session, stack) == upstream
    return statuses


async def post_all(session, requests: list[tuple[str, dict]], concurrency: int = 32) -> Counter:
    statuses: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(target: str, headers: dict) -> None:
        async with gate:
            try:
                async with session.post(target, json=BODY, headers=headers) as r:
                    statuses[r.status] += 1
            except aiohttp.ClientError:
                statuses["closed"] += 1
    await asyncio.gather(*(one(t, h) for t, h in requests))
    return statuses


@pytest.mark.parametrize("listener", LISTENERS)
async def test_oversized_headers_and_header_floods_are_431(stack, listener, record_property):
    key = {"Authorization": f"Bearer {stack.api_key('user')}"}
    big = {**key, "x-filler": "a" * 100_000}  # beyond Envoy's 60 KiB of request headers
    flood = {**key, **{f"x-h{i}": "v" for i in range(150)}}  # beyond Envoy's 100 headers
    async with aiohttp.ClientSession(max_field_size=200_000) as session:
        statuses = await unseen(stack, session, lambda: post_all(session, [(url(stack, listener), big)] * 10
                                                                  + [(url(stack, listener), flood)] * 10))
    assert statuses == Counter({431: 20}), statuses
    record_property(f"headers_{listener}", f"sent 20 (10 with 100 kB of headers, 10 with 150 headers): {dict(statuses)}")


@pytest.mark.parametrize("listener", LISTENERS)
async def test_invalid_keys_at_a_high_rate_are_401(stack, listener, record_property):
    n = 600
    requests = [(url(stack, listener), {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"}) for _ in range(n)]
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        statuses = await unseen(stack, session, lambda: post_all(session, requests, concurrency=64))
        elapsed = time.monotonic() - start
    assert statuses == Counter({401: n}), statuses
    record_property(f"invalid_keys_{listener}", f"sent {n} in {elapsed:.1f} s ({n / elapsed:.0f}/s): {dict(statuses)}")


@pytest.mark.parametrize("listener", LISTENERS)
async def test_a_key_in_the_query_string_is_401(stack, listener, record_property):
    """Keys are read from headers only: one in the URL (where logs and proxies keep it) opens nothing."""
    key = stack.api_key("user")
    targets = [url(stack, listener, f"?{name}={key}") for name in ("api_key", "key", "x-api-key", "authorization")]
    async with aiohttp.ClientSession() as session:
        statuses = await unseen(stack, session, lambda: post_all(session, [(t, {}) for t in targets]))
    assert statuses == Counter({401: len(targets)}), statuses
    record_property(f"query_key_{listener}", f"sent {len(targets)}: {dict(statuses)}")


def http_timeout(stack, field: str) -> float:
    """One of the listeners' ClientTrafficPolicy HTTP timeouts (s) as the stack rendered it from the
    cluster's manifests."""
    from validation.manifests import seconds
    ctp = next(d for d in stack.topology.gateway if d.get("kind") == "ClientTrafficPolicy")
    return seconds(ctp["spec"]["timeout"]["http"][field])


async def read_until_closed(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """(when the first byte came, everything the server sent) until it closes the connection (or
    resets it: Envoy does when a client keeps writing to a connection it has answered)."""
    data, first = b"", None
    try:
        while chunk := await reader.read(4096):
            first = first or time.monotonic()
            data += chunk
    except ConnectionResetError:
        pass
    return first or time.monotonic(), data


async def dribble(host: str, port: int, key: str, every: float, give_up: float) -> tuple[float, float, bytes]:
    """A slowloris client: a request line, then one header line every `every` s, never the end of the
    headers. Returns (seconds until Envoy answered, until it closed the connection, what it
    answered); (give_up, give_up, b"") if it was still open then."""
    reader, writer = await asyncio.open_connection(host, port)
    start = time.monotonic()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n".encode())
    answer = asyncio.ensure_future(read_until_closed(reader))
    try:
        while not answer.done() and time.monotonic() - start < give_up:
            try:
                writer.write(b"x-slow: a\r\n")
                await writer.drain()
            except ConnectionError:
                await answer
                break
            await asyncio.wait([answer], timeout=every)
        if not answer.done():
            return give_up, give_up, b""
        answered, data = answer.result()
        return answered - start, time.monotonic() - start, data
    finally:
        answer.cancel()
        writer.close()


async def test_slow_clients_are_cut_at_the_header_timeout(stack, record_property):
    """Slowloris: 50 connections sending a request's headers a line every second, never finishing
    them. None reaches the picker or a backend while it dribbles, a normal client is served
    meanwhile, and Envoy cuts every one at the ClientTrafficPolicy's requestHeadersReceivedTimeout
    (the cluster's 10 s, rendered from the same manifest, well before the whole request's 60 s
    requestReceivedTimeout; make validate checks the generated Envoy config holds both) with 408:
    the test waits for it."""
    limit = http_timeout(stack, "requestHeadersReceivedTimeout")
    assert limit < http_timeout(stack, "requestReceivedTimeout")
    key = stack.api_key("user")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {stack.api_key('loadtest')}"}) as session:
        decisions, upstream = len(picker_decisions(stack)), await envoy_upstream_requests(session, stack)
        slow = [asyncio.ensure_future(dribble("127.0.0.1", stack.llm_port if i % 2 else stack.http_port, key,
                                              every=1.0, give_up=limit + 30)) for i in range(50)]
        await asyncio.sleep(3)
        async with session.post(url(stack, "llm-gw"), json=BODY) as r:
            assert r.status == 200, await r.text()
        cuts = await asyncio.gather(*slow)
        await asyncio.sleep(0.5)
        assert len(picker_decisions(stack)) == decisions + 1  # only the normal client's request
        after = await envoy_upstream_requests(session, stack)
        assert sum(after.values()) == sum(upstream.values()) + 1
    answered, closed = sorted(a for a, _, _ in cuts), sorted(c for _, c, _ in cuts)
    statuses = Counter(answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
                       for _, _, answer in cuts)
    assert statuses == Counter({"408": 50}), statuses
    assert limit - 0.5 <= answered[0] and closed[-1] <= limit + 5, (answered, closed)
    record_property("slowloris", f"50 connections dribbling a header line a second: all answered {dict(statuses)} "
                                 f"by Envoy after {answered[0]:.1f}-{answered[-1]:.1f} s (requestHeadersReceivedTimeout "
                                 f"{limit:g} s) and closed by {closed[-1]:.1f} s; 0 reached the picker or a backend; "
                                 f"a normal request served meanwhile")
