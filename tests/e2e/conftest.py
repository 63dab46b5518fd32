"""Fixtures for the end-to-end tests: the whole local stack (simulators, picker, Envoy Gateway
standalone + the real Envoy) on free loopback ports. Envoy Gateway itself binds fixed ports, so
the stacks of these tests run one at a time."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
import re
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from local.stack.processes import free_ports
from local.stack import Stack, StackConfig

SPEEDUP = 100.0
SCRAPE_INTERVAL = 0.2  # picker --scrape-interval in the e2e stacks (seconds)


def start_stack(run_root: Path, name: str, groups: int = 3, canary: bool = False,
                scrape_interval: float = SCRAPE_INTERVAL, picker_args_extra: list[str] = (),
                **overrides) -> Stack:
    """The picker logs each decision (debug) so tests can compare its choice with the gateway's."""
    ports = free_ports(6 + groups + (1 if canary else 0))
    config = StackConfig(
        name=name, run_root=run_root, groups=groups, canary=canary, speedup=SPEEDUP, seed=7,
        sim_ports=ports[6:], http_port=ports[0], llm_port=ports[1],
        picker_grpc_port=ports[2], picker_health_port=ports[3], picker_metrics_port=ports[4],
        picker_outcomes_port=ports[5],
        picker_args=["--log-level", "debug", "--scrape-interval", str(scrape_interval),
                     *picker_args_extra], **overrides)
    return Stack(config).start()


def json_lines(path: str) -> list[dict]:
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def picker_decisions(stack: Stack) -> list[str]:
    """The endpoint of every decision so far, in order, from the picker's own decision log."""
    return [r["endpoint"] for r in json_lines(stack.proc("picker").log) if r.get("msg") == "decision"]


async def envoy_upstream_requests(session: aiohttp.ClientSession, stack: Stack) -> dict[str, int]:
    """ip:port -> requests Envoy sent to that upstream host, summed over the vLLM clusters, from
    Envoy's own admin API (/clusters). Envoy counts a request there when it picks the host."""
    async with session.get(f"{stack.envoy_admin()}/clusters?format=json") as r:
        data = await r.json()
    sims = {s.address for s in stack.topology.sims}
    out: dict[str, int] = {}
    for cluster in data.get("cluster_statuses", []):
        for host in cluster.get("host_statuses", []):
            sock = host["address"]["socket_address"]
            address = f"{sock['address']}:{sock['port_value']}"
            if address in sims:
                stats = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
                out[address] = out.get(address, 0) + stats.get("rq_total", 0)
    return out


async def envoy_stats(session: aiohttp.ClientSession, stack: Stack, prefix: str = "") -> dict[str, int]:
    """Envoy's counters and gauges (admin /stats), optionally only those starting with prefix."""
    async with session.get(f"{stack.envoy_admin()}/stats?format=json") as r:
        data = await r.json()
    return {s["name"]: s["value"] for s in data["stats"] if "value" in s and s["name"].startswith(prefix)}


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


METRIC = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+eE0-9.naNIf]+)', re.M)


async def scrape(session: aiohttp.ClientSession, url: str) -> list[tuple[str, str, float]]:
    async with session.get(url) as r:
        text = await r.text()
    return [(m.group(1), m.group(2) or "", float(m.group(3))) for m in METRIC.finditer(text)]


async def successes(session: aiohttp.ClientSession, address: str) -> float:
    """vllm:request_success_total summed over labels, read from the simulator itself."""
    rows = await scrape(session, f"http://{address}/metrics")
    return sum(v for name, _, v in rows if name == "vllm:request_success_total")


def completion(prompt: str = "Say hello", max_tokens: int = 4, stream: bool = False, model: str = "qwq",
               **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat(content: str = "Say hello", max_tokens: int = 4, stream: bool = False, model: str = "qwq") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def read_sse(response: aiohttp.ClientResponse) -> list:
    """The data: events of an SSE body; '[DONE]' stays a string."""
    events = []
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# requests per second that stream_load sends at most: below the refill of the `loadtest` key's
# rate limit (components/edge-security/backend-traffic.yaml), so the edge never answers 429 to a
# test that measures the backends
LOAD_RATE = 60.0


def stream_load(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, results: list, *,
                workers: int = 6, max_tokens: int = 6, request_id: str = "load",
                timeout: float | None = None, statuses: Counter | None = None) -> list[asyncio.Future]:
    """`workers` clients sending streamed completions to `url` back to back, LOAD_RATE a second
    at most in all, until `stop` is set (await the returned tasks after setting it). Each request
    appends (sent, ok, seconds) to `results`: ok = a 200 whose stream ended with [DONE]; `statuses`
    counts the HTTP statuses (0: no answer); `timeout`: the client's limit per request (None: the
    session's)."""
    options = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
    gap = workers / LOAD_RATE  # s between two sends of one worker

    async def worker(w: int) -> None:
        i, next_send = 0, time.monotonic() + w * gap / workers
        while not stop.is_set():
            await asyncio.sleep(max(0.0, next_send - time.monotonic()))
            next_send += gap
            sent, i, status = time.time(), i + 1, 0
            body = completion(prompt=f"client {w} request {i} " * 10, max_tokens=max_tokens, stream=True)
            try:
                async with session.post(url, json=body, headers={"x-request-id": f"{request_id}-{uuid.uuid4()}"},
                                        **options) as r:
                    status = r.status
                    events = await read_sse(r) if r.status == 200 else []
                    ok = r.status == 200 and events[-1:] == ["[DONE]"]
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            results.append((sent, ok, time.time() - sent))
            if statuses is not None:
                statuses[status] += 1
    return [asyncio.ensure_future(worker(w)) for w in range(workers)]


@pytest.fixture
async def session(stack):
    """A client of the module's stack with its load generators' key (client id `loadtest`), as
    `make demo` and the load tests send it: every request passes the edge."""
    async with aiohttp.ClientSession(headers=stack.auth_headers(), timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s
