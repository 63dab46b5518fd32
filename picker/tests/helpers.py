"""Shared test helpers: vLLM-like metrics text, a fake clock, a router on a fixed endpoint set,
a fake vLLM server (/metrics and /v1/models) on 127.0.0.1, free ports."""
from __future__ import annotations

import asyncio
import inspect
import json
import random
import socket

from aiohttp import web

from picker.app import App
from picker.config import parse_args
from picker.core import Router, RouterSettings
from picker.scheduling.profile import load_profile


def metrics_text(waiting=0, running=0, kv=0.0, model="qwq", block_size=16, num_blocks=4000,
                 old_kv_name=False, lora=None, extra=""):
    kv_name = "vllm:gpu_cache_usage_perc" if old_kv_name else "vllm:kv_cache_usage_perc"
    lines = [
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}',
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}',
        f"# TYPE {kv_name} gauge",
        f'{kv_name}{{engine="0",model_name="{model}"}} {kv}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="{model}"}} 3.0',
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{model}"}} 3.0',
    ]
    if block_size is not None:
        lines.append("# TYPE vllm:cache_config_info gauge")
        lines.append(f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
                     f'engine="0",model_name="{model}",num_gpu_blocks="{num_blocks}"}} 1.0')
    if lora is not None:
        lines.append("# TYPE vllm:lora_requests_info gauge")
        lines.append(f'vllm:lora_requests_info{{max_lora="{lora["max"]}",running_lora_adapters='
                     f'"{",".join(lora.get("running", []))}",waiting_lora_adapters='
                     f'"{",".join(lora.get("waiting", []))}"}} 1.7e9')
    return "\n".join(lines) + "\n" + extra


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_router(profile="upstream-default", n=3, clock=None, seed=1, objectives=(), rewrites=(),
                settings=None, metrics=None, scrape=True, **load):
    clock = clock or FakeClock()
    router = Router(load_profile(profile), objectives=objectives, rewrites=rewrites, clock=clock,
                    rng=random.Random(seed), settings=settings or RouterSettings(), metrics=metrics)
    addrs = [f"10.0.0.{i + 1}:8000" for i in range(n)]
    router.set_endpoints(addrs)
    if scrape:
        for a in addrs:
            router.on_scrape_ok(a, metrics_text(**load))
    return router


def body(model="qwq", prompt="hello world", **extra) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, **extra}).encode()


class FakeVllm:
    """/metrics answers `text` with `status`; /v1/models answers `models` (a JSON document; None:
    no such route, 404). `hits` and `model_hits` count the requests."""

    def __init__(self, text: str | None = None, models: dict | None = None):
        self.text = metrics_text(waiting=2, running=1, kv=0.3) if text is None else text
        self.status = 200
        self.hits = 0
        self.models = models
        self.model_hits = 0

    async def metrics(self, request):
        self.hits += 1
        return web.Response(text=self.text, status=self.status)

    async def list_models(self, request):
        self.model_hits += 1
        if self.models is None:
            return web.Response(status=404)
        return web.json_response(self.models)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.list_models)

    async def start(self):
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self):
        await self.runner.cleanup()


async def until(pred, timeout=5.0, every=0.01):
    """Poll `pred` (a function, or a coroutine function for checks that do I/O) until it holds;
    fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        ok = pred()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert loop.time() < end
        await asyncio.sleep(every)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports nobody listens on now on 127.0.0.1 (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def start_app(extra: list[str], endpoints: list[str],
                    scrape_interval: float = 0.05) -> tuple[App, int, asyncio.Task]:
    """The whole service in this process (`python -m picker` with static discovery, plaintext
    gRPC on a free port): the App, its metrics port and its maintain() task."""
    metrics_port, = free_ports(1)
    args = parse_args(["--grpc-port", "0", "--health-port", "0", "--metrics-port",
                       str(metrics_port), "--outcomes-port", "0", "--bind", "127.0.0.1", "--no-secure-serving",
                       "--discovery", "static", "--endpoints", ",".join(endpoints),
                       "--scrape-interval", str(scrape_interval), *extra])
    app = App(args)
    await app.start()
    return app, metrics_port, asyncio.create_task(app.maintain())
