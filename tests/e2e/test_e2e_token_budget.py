"""Per-client token budgets through the real Envoy (components/token-budget): Envoy Gateway's global
rate limit, the Envoy rate limit service (Go) and Redis, as a cluster runs them (local/ratelimit.py).
One budget per client for both listeners; the prompt's estimated tokens are charged at admission,
the completion's from the response's usage when the response ends; a client over budget gets 429
with the budget in its x-ratelimit-* headers before the picker sees the request. Non-streamed, the
first refusal comes within one request of the budget; streamed, the tokens served beyond the budget
are measured and bounded by what was in flight when the budget ran out.

The budget is set the way an operator sets it (the Gateway's BackendTrafficPolicy, here in the
files Envoy Gateway reads) to a few thousand tokens per hour, so the test sends little."""

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
from tests.e2e.conftest import picker_decisions, start_stack, wait_for

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
    while f"requests_per_unit={tokens}," not in urllib.request.urlopen(debug, timeout=5).read().decode():
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
                    refused = (i, listener, {k.lower(): v for k, v in r.headers.items()}, await r.text())
                    break
                assert r.status == 200, await r.text()
                charged.append((math.ceil(len(sent) / 4), charge(sent, (await r.json())["usage"])))
                served_llm += listener == "llm-gw"
    assert refused is not None, "never refused"
    index, listener, answer_headers, _ = refused
    # the first request whose admission charge no longer fits what was charged before it
    total, predicted = 0, len(charged)
    for k, (estimate, cost) in enumerate(charged):
        if total + estimate > budget:
            predicted = k
            break
        total += cost
    assert index in (predicted, predicted + 1), (index, predicted, charged)  # within one request
    assert sum(c for _, c in charged) - budget <= max(c for _, c in charged)  # at most one request beyond
    # refused by the budget (Envoy's global rate limit counted it over limit), not the request limit;
    # the x-ratelimit-* headers name the budget (`<tokens>;w=3600`, 0 left) or, when the request
    # limit's filter writes its own over them, that limit's (seen both ways)
    async with aiohttp.ClientSession() as admin:
        async with admin.get(f"{stack.envoy_admin()}/stats?format=json") as r:
            stats = {s["name"]: s.get("value", 0) for s in (await r.json())["stats"] if "value" in s}
    over = sum(v for k, v in stats.items() if k.startswith("cluster.httproute/") and k.endswith(".ratelimit.over_limit"))
    assert over >= 1, stats
    limit = answer_headers.get("x-ratelimit-limit", "")
    assert f"{budget};w=3600" in limit or limit == "120", answer_headers
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
