"""Benchmark of the gateway's streaming path: SSE events per second through 8080 and 8081.

    python -m local.gateway.bench [--streams 32] [--requests 256] [--events 200] [--json FILE]

Starts, on free loopback ports: a fast fake vLLM upstream (one SSE event per write, no model
time), the real picker (static discovery, plaintext) and the gateway, each in its own process;
then streams through each listener and body mode and reports events/s and the CPU seconds the
gateway (and the picker) spent per 1,000 events. A benchmark, not a test; the numbers depend on
what else runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import aiohttp
import psutil
from aiohttp import web

from local.stack import grpc_serving, http_ok, python_env, stop_groups

METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="qwq",engine="0"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="qwq",engine="0"}} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="qwq",engine="0"}} 0.1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="2350",engine="0"}} 1
"""


def serve_upstream(port: int, events: int) -> None:
    running = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal running
        await request.read()
        running += 1
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(events):
                await response.write(b'data: {"choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n')
                await asyncio.sleep(0)  # one event per write, as an engine step would emit it
            await response.write(b"data: [DONE]\n\n")
        finally:
            running -= 1
        return response

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS.format(running=running), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


async def wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.get_running_loop().run_in_executor(None, check):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not become healthy")
        await asyncio.sleep(0.1)


async def wait_routable(url: str, timeout: float = 30) -> None:
    """Until the picker has scraped the upstream once, 8081 answers 503 (no ready endpoint)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.post(url, json={"model": "qwq", "prompt": "hi", "stream": True}) as r:
                await r.read()
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} still answers {r.status} after {timeout:g} s")
            await asyncio.sleep(0.1)


async def stream_load(url: str, streams: int, requests: int) -> tuple[int, float]:
    events = 0
    sem = asyncio.Semaphore(streams)
    async with aiohttp.ClientSession() as session:
        async def one():
            nonlocal events
            async with sem:
                async with session.post(url, json={"model": "qwq", "prompt": "hi", "stream": True}) as r:
                    assert r.status == 200, r.status
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events += 1
        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(requests)))
        return events, time.monotonic() - start


def cpu(p: subprocess.Popen) -> float:
    t = psutil.Process(p.pid).cpu_times()
    return t.user + t.system


async def run(args) -> dict:
    up, http, llm, admin, grpc_port, health, metrics = free_ports(7)
    result = {"streams": args.streams, "requests": args.requests, "events_per_stream": args.events,
              "cpus": psutil.cpu_count(), "load_average_start": psutil.getloadavg()[0], "listeners": []}
    py = sys.executable
    procs = [spawn([py, "-m", "local.gateway.bench", "--serve-upstream", str(up), "--events", str(args.events)])]
    try:
        await wait(lambda: http_ok(f"http://127.0.0.1:{up}/health"), "upstream")
        print(f"{args.requests} streams of {args.events} SSE events, {args.streams} at a time; "
              f"{psutil.cpu_count()} cores, load average {psutil.getloadavg()[0]:.1f} before the runs")
        print(f"{'listener':<28} {'events/s':>10} {'gateway CPU s/1k ev':>20} {'picker CPU s/1k ev':>19}")
        for mode in ("buffered", "full-duplex"):
            picker = spawn([py, "-m", "picker", "--grpc-port", str(grpc_port), "--health-port", str(health),
                            "--metrics-port", str(metrics), "--no-secure-serving", "--discovery", "static",
                            "--endpoints", f"127.0.0.1:{up}", "--request-body-mode", mode, "--bind", "127.0.0.1",
                            "--log-level", "warning",
                            # The fake upstream's event loop is busy streaming, so its /metrics can
                            # answer late; this measures streaming, not freshness: lenient timers.
                            "--scrape-interval", "0.5", "--staleness", "10"])
            gateway = spawn([py, "-m", "local.gateway", "--endpoints", f"127.0.0.1:{up}", "--http-port", str(http),
                             "--llm-port", str(llm), "--admin-port", str(admin), "--picker", f"127.0.0.1:{grpc_port}",
                             "--body-mode", mode, "--log-level", "WARNING"])
            procs += [picker, gateway]
            await wait(lambda: grpc_serving(f"127.0.0.1:{health}"), "picker")
            await wait(lambda: http_ok(f"http://127.0.0.1:{admin}/health"), "gateway")
            listeners = [("http", http)] if mode == "buffered" else []
            listeners.append((f"llm-gw ({mode})", llm))
            for name, port in listeners:
                await wait_routable(f"http://127.0.0.1:{port}/v1/completions")
                g0, p0 = cpu(gateway), cpu(picker)
                events, seconds = await stream_load(f"http://127.0.0.1:{port}/v1/completions", args.streams,
                                                    args.requests)
                g, p = cpu(gateway) - g0, cpu(picker) - p0
                row = {"listener": name, "events": events, "events_per_s": events / seconds,
                       "gateway_cpu_s_per_1k_events": 1000 * g / events,
                       "picker_cpu_s_per_1k_events": 1000 * p / events}
                result["listeners"].append(row)
                print(f"{name:<28} {row['events_per_s']:>10,.0f} {row['gateway_cpu_s_per_1k_events']:>20.3f} "
                      f"{row['picker_cpu_s_per_1k_events']:>19.3f}")
            stop_groups([picker.pid, gateway.pid])
            procs = procs[:1]
    finally:
        stop_groups([p.pid for p in procs])
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m local.gateway.bench", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.events)
        return
    result = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
