"""Per-client token budgets through the real Envoy (components/token-budget): Envoy Gateway's global
rate limit, the Envoy rate limit service (Go) and Redis, as a cluster runs them (local/ratelimit.py).
One budget per client for both listeners; the prompt's estimated tokens are charged at admission,
the completion's from the response's usage when the response ends; a client over budget gets 429
before the picker sees the request, with an OpenAI-style error that names the budget and the
budget's x-ratelimit-* headers alone, told apart from the request rate limit's 429. Non-streamed,
the first refusal comes within one request of the budget; streamed, the tokens served beyond the
budget are measured and bounded by what was in flight when the budget ran out; at a window's edge a
client can spend up to two budgets within seconds (fixed windows). Without the key Secret, both
listeners refuse every request before the picker.

The budget is set the way an operator sets it (the Gateway's BackendTrafficPolicy, here in the
files Envoy Gateway reads) to a few thousand tokens per hour (or minute), so the test sends little."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
import urllib.request

import aiohttp
import pytest
import yaml

from local import dataplane
from tests.e2e.conftest import envoy_upstream_requests, picker_decisions, start_stack, wait_for

pytestmark = pytest.mark.e2e
POLICY = "inference-gateway-token-budget"
CLIENT = "user"  # rule 0 of the budget: every client but the load generator


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("budget"), "budget", groups=2, token_budget=True)
    yield s
    s.stop()


def set_budget(stack, tokens: int, unit: str = "Hour") -> None:
    """Change the budget of every client but `loadtest` and wait until the rate limit service has it
    (Envoy Gateway watches its files and pushes the new configuration over xDS)."""
    path = stack.layout.resources / "gateway.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    policy = next(d for d in docs if d["kind"] == "BackendTrafficPolicy" and d["metadata"]["name"] == POLICY)
    policy["spec"]["rateLimit"]["global"]["rules"][0]["limit"] = {"requests": tokens, "unit": unit}
    dataplane.write_atomically(path, dataplane.dump(docs))
    debug = f"http://127.0.0.1:{stack.config.ratelimit_debug_port}/rlconfig"
    deadline = time.monotonic() + 60
    while f"unit={unit.upper()} requests_per_unit={tokens}," not in urllib.request.urlopen(debug, timeout=5).read().decode():
        assert time.monotonic() < deadline, "the rate limit service never got the new budget"
        time.sleep(0.2)
    # a fresh count: the previous test's tokens and a window that does not end during the test
    subprocess.run(["redis-cli", "-p", str(stack.config.redis_port), "FLUSHALL"], check=True, capture_output=True)
    if time.gmtime().tm_min >= 58:
        time.sleep(60 * (60 - time.gmtime().tm_min) - time.gmtime().tm_sec + 1)


def url(stack, listener: str) -> str:
    return f"http://127.0.0.1:{stack.http_port if listener == 'http' else stack.llm_port}/v1/completions"


def body(max_tokens: int, stream: bool = False) -> bytes:
    payload = {"model": "qwq", "prompt": "Tell me about budgets " * 8, "max_tokens": max_tokens, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


def ratelimit_headers(response: aiohttp.ClientResponse) -> dict[str, list[str]]:
    """Every value of each x-ratelimit-* header the client got (a name Envoy added twice has two)."""
    names = {k.lower() for k in response.headers if k.lower().startswith("x-ratelimit-")}
    return {name: response.headers.getall(name) for name in sorted(names)}


def charge(sent: bytes, usage: dict) -> int:
    """What components/token-budget/token-accounting.lua charges for one served request."""
    estimate = math.ceil(len(sent) / 4)
    return estimate + usage["completion_tokens"] + max(0, usage["prompt_tokens"] - estimate)


async def test_a_client_over_budget_is_refused_within_one_request(stack, record_property):
    budget, max_tokens = 1500, 60
    set_budget(stack, budget)
    decisions = len(picker_decisions(stack))
    headers = {"Authorization": f"Bearer {stack.api_key(CLIENT)}", "Content-Type": "application/json"}
    charged, served_llm, refused = [], 0, None
    async with aiohttp.ClientSession(headers=headers) as session:
        for i in range(100):  # alternate listeners: one budget for both
            listener = ("http", "llm-gw")[i % 2]
            sent = body(max_tokens)
            async with session.post(url(stack, listener), data=sent) as r:
                if r.status == 429:
                    refused = (i, listener, ratelimit_headers(r), await r.json())
                    break
                assert r.status == 200, await r.text()
                charged.append((math.ceil(len(sent) / 4), charge(sent, (await r.json())["usage"])))
                served_llm += listener == "llm-gw"
    assert refused is not None, "never refused"
    index, listener, answer_headers, answer = refused
    # the first request whose admission charge no longer fits what was charged before it
    total, predicted = 0, len(charged)
    for k, (estimate, cost) in enumerate(charged):
        if total + estimate > budget:
            predicted = k
            break
        total += cost
    assert index in (predicted, predicted + 1), (index, predicted, charged)  # within one request
    assert sum(c for _, c in charged) - budget <= max(c for _, c in charged)  # at most one request beyond
    # refused by the budget (Envoy's global rate limit counted it over limit), not the request limit,
    # and the answer says so: an OpenAI-style error naming the budget, and the budget's headers alone
    # (one value each: the request limit's are off where a budget runs)
    assert answer["error"]["code"] == "token_budget_exceeded", answer
    assert answer["error"]["type"] == "rate_limit_error" and f"budget of {budget} tokens per 3600 s" in answer[
        "error"]["message"], answer
    assert answer_headers["x-ratelimit-limit"] == [f"{budget}, {budget};w=3600"], answer_headers
    assert answer_headers["x-ratelimit-remaining"] == ["0"], answer_headers
    reset = int(answer_headers["x-ratelimit-reset"][0])
    assert 0 < reset <= 3600 and f"window ends in {reset} s" in answer["error"]["message"], (reset, answer)
    async with aiohttp.ClientSession() as admin:
        async with admin.get(f"{stack.envoy_admin()}/stats?format=json") as r:
            stats = {s["name"]: s.get("value", 0) for s in (await r.json())["stats"] if "value" in s}
    over = sum(v for k, v in stats.items() if k.startswith("cluster.httproute/") and k.endswith(".ratelimit.over_limit"))
    assert over >= 1, stats
    # refused before the picker: it decided exactly the served 8081 requests
    await wait_for(lambda: len(picker_decisions(stack)) >= decisions + served_llm)
    await asyncio.sleep(0.3)
    assert len(picker_decisions(stack)) == decisions + served_llm
    record_property("sequential", json.dumps({"budget": budget, "served": len(charged), "refused_at": index,
                                              "predicted": predicted, "charged": sum(c for _, c in charged)}))


async def test_streamed_overshoot_is_bounded_by_what_is_in_flight(stack, record_property):
    """Workers stream concurrently until refused. What the budget cannot stop: the requests admitted
    before their completions were charged. Bound: every worker's last admitted request, i.e.
    workers x (the largest charge of one request)."""
    budget, max_tokens, workers = 4000, 120, 6
    set_budget(stack, budget)
    headers = {"Authorization": f"Bearer {stack.api_key(CLIENT)}", "Content-Type": "application/json"}
    charges: list[int] = []
    refused = 0

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        nonlocal refused
        for i in range(200):
            sent = body(max_tokens, stream=True)
            async with session.post(url(stack, ("http", "llm-gw")[(w + i) % 2]), data=sent) as r:
                if r.status == 429:
                    refused += 1
                    return
                assert r.status == 200, await r.text()
                usage = None
                async for line in r.content:
                    text = line.decode().strip()
                    if text.startswith("data: {") and '"usage"' in text:
                        usage = json.loads(text[6:]).get("usage") or usage
                assert usage, "no usage in the stream"
                charges.append(charge(sent, usage))

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(worker(w, session) for w in range(workers)))
    assert refused == workers
    overshoot = sum(charges) - budget
    bound = workers * max(charges)
    record_property("streamed", json.dumps({"budget": budget, "workers": workers, "served": len(charges),
                                            "charged": sum(charges), "overshoot": overshoot, "bound": bound}))
    assert sum(charges) >= budget - max(charges)  # the budget was used, not refused early
    assert overshoot <= bound, (overshoot, bound, charges)


async def test_a_missing_key_secret_fails_closed_before_the_picker(stack):
    """The key Secret removed from a running Gateway: Envoy Gateway drops the API-key filter and turns
    the routes into a direct 500, which Envoy answers only after the filters before its router, the
    picker's ext_proc among them. The token accounting filter (after authentication, before the rate
    limits and the picker) refuses every request no key authenticated, also one that names a client
    itself: 500 with a JSON error on both listeners, and the picker decides nothing. With the Secret
    back, the key works again."""
    path = stack.layout.resources / "gateway.yaml"
    original = path.read_text()
    docs = [d for d in yaml.safe_load_all(original) if d]
    kept = [d for d in docs if not (d["kind"] == "Secret" and d["metadata"]["name"] == "inference-gateway-api-keys")]
    assert len(kept) == len(docs) - 1
    key = {"Authorization": f"Bearer {stack.api_key('loadtest')}"}  # its request limit leaves room to poll
    callers = (key, {**key, "x-client-id": CLIENT}, {"x-client-id": "loadtest"})

    async def answers(session) -> list[tuple[int, dict]]:
        out = []
        for listener in ("http", "llm-gw"):
            for headers in callers:
                async with session.post(url(stack, listener), json={"model": "qwq", "prompt": "hi", "max_tokens": 1},
                                        headers=headers) as r:
                    out.append((r.status, await r.json(content_type=None) if r.status != 401 else {}))
        return out

    # a request that hangs fails the test in 30 s, naming it, instead of at pytest's 300 s timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        set_budget(stack, 10_000_000)
        assert [s for s, _ in await answers(session)] == [200, 200, 401] * 2
        try:
            dataplane.write_atomically(path, dataplane.dump(kept))
            deadline = time.monotonic() + 30
            while {s for s, _ in await answers(session)} != {500}:
                assert time.monotonic() < deadline, "the Gateway never noticed the missing Secret"
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the change has arrived everywhere
            decisions, upstream = len(picker_decisions(stack)), await envoy_upstream_requests(session, stack)
            for _ in range(5):
                found = await answers(session)
                assert {s for s, _ in found} == {500}, found
                assert {b["error"]["code"] for _, b in found} == {"authentication_unavailable"}, found
            await asyncio.sleep(0.5)
            assert len(picker_decisions(stack)) == decisions  # the picker saw none of them
            assert await envoy_upstream_requests(session, stack) == upstream  # nor did a backend
        finally:
            dataplane.write_atomically(path, original)
        deadline = time.monotonic() + 30
        while [s for s, _ in await answers(session)] != [200, 200, 401] * 2:
            assert time.monotonic() < deadline, "the key never worked again"
            await asyncio.sleep(0.2)


async def test_a_window_edge_lets_a_client_spend_up_to_twice_the_budget(stack, record_property):
    """The budget's window is fixed (the rate limit service counts per calendar minute, hour, ...):
    a client that spends its budget just before a window ends gets a whole budget again when the next
    one starts. Measured with a per-minute budget: spent from second 50, then again from second 0,
    within a few seconds; at most 2 budgets plus the one request that crosses each. Over 30 s: it
    waits for second 50 of the current minute (up to a minute) to spend the budget at a window's edge."""
    budget, max_tokens = 1500, 60
    set_budget(stack, budget, unit="Minute")
    now = time.time()
    await asyncio.sleep((50 - now % 60) % 60)  # second 50 of a minute
    headers = {"Authorization": f"Bearer {stack.api_key(CLIENT)}", "Content-Type": "application/json"}

    async def spend(session) -> list[int]:
        charges = []
        for i in range(100):
            sent = body(max_tokens)
            async with session.post(url(stack, ("http", "llm-gw")[i % 2]), data=sent) as r:
                if r.status == 429:
                    assert (await r.json())["error"]["code"] == "token_budget_exceeded"
                    return charges
                assert r.status == 200, await r.text()
                charges.append(charge(sent, (await r.json())["usage"]))
        raise AssertionError("never refused")

    async with aiohttp.ClientSession(headers=headers) as session:
        start = time.time()
        first = await spend(session)
        assert time.time() % 60 < 59, "the first budget took too long to spend"
        await asyncio.sleep(60 - time.time() % 60 + 0.5)  # the next minute
        second = await spend(session)
        span = time.time() - start
    spent, largest = sum(first) + sum(second), max(first + second)
    record_property("window_edge", json.dumps({"budget": budget, "unit": "Minute", "spent": spent, "span_s": round(span, 1),
                                               "first_window": sum(first), "second_window": sum(second)}))
    assert span < 60, span
    assert sum(first) >= budget - largest and sum(second) >= budget - largest, (first, second)
    assert spent <= 2 * (budget + largest), (spent, first, second)


@pytest.mark.parametrize("listener", ("http", "llm-gw"))
async def test_the_request_limit_refusal_is_told_apart_from_the_budget(stack, listener, record_property):
    """With a budget large enough not to refuse, a burst beyond the request rate limit (120 a minute,
    components/edge-security): its 429s say `request_rate_limited` in the same error shape and carry
    no x-ratelimit-* header, the served answers carry the budget's headers alone, and the picker routes
    only the served requests."""
    set_budget(stack, 10_000_000)
    decisions = len(picker_decisions(stack))
    headers = {"Authorization": f"Bearer {stack.api_key(CLIENT)}"}

    async def one(session, i):
        async with session.post(url(stack, listener), json={"model": "qwq", "prompt": f"burst {i}", "max_tokens": 1},
                                headers=headers) as r:
            return r.status, ratelimit_headers(r), await r.json()

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session, i) for i in range(140)))
    refused = [(h, b) for status, h, b in results if status == 429]
    served = [(h, b) for status, h, b in results if status == 200]
    assert refused and served and len(refused) + len(served) == len(results), [r[0] for r in results]
    assert {b["error"]["code"] for _, b in refused} == {"request_rate_limited"}, refused[0]
    assert all(h == {} for h, _ in refused), refused[0]
    assert all(h["x-ratelimit-limit"] == ["10000000, 10000000;w=3600"] and len(h["x-ratelimit-remaining"]) == 1
               for h, _ in served), served[0]
    if listener == "llm-gw":
        await wait_for(lambda: len(picker_decisions(stack)) >= decisions + len(served))
        await asyncio.sleep(0.3)
        assert len(picker_decisions(stack)) == decisions + len(served)
    record_property(f"request_limit_{listener}", json.dumps({"sent": len(results), "served": len(served),
                                                              "refused": len(refused),
                                                              "body": refused[0][1]["error"]["code"]}))
