"""Fixtures for the end-to-end tests: the whole local stack on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from local.stack import Stack, StackConfig

SPEEDUP = 100.0
SCRAPE_INTERVAL = 0.2  # picker --scrape-interval in the e2e stacks (seconds)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_stack(run_root: Path, name: str, groups: int = 3, canary: bool = False,
                scrape_interval: float = SCRAPE_INTERVAL, **overrides) -> Stack:
    """The picker logs each decision (debug) so tests can compare its choice with the gateway's."""
    ports = free_ports(6 + groups + (1 if canary else 0))
    config = StackConfig(
        name=name, run_root=run_root, groups=groups, canary=canary, speedup=SPEEDUP, seed=7,
        sim_ports=ports[6:], http_port=ports[0], llm_port=ports[1], admin_port=ports[2],
        picker_grpc_port=ports[3], picker_health_port=ports[4], picker_metrics_port=ports[5],
        picker_args=["--log-level", "debug", "--scrape-interval", str(scrape_interval)], **overrides)
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


def picker_decisions(stack: Stack) -> dict[str, str]:
    """request id -> endpoint, from the picker's own decision log."""
    return {r["request_id"]: r["endpoint"] for r in json_lines(stack.proc("picker").log)
            if r.get("msg") == "decision"}


def gateway_log(stack: Stack) -> list[dict]:
    return [r for r in json_lines(stack.proc("gateway").log) if "listener" in r]


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


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s
