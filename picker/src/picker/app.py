"""Wire discovery -> signals -> scheduling -> protocol and run until SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from argparse import Namespace
from typing import Any, Coroutine, TypeVar

import uvloop

from prometheus_client import start_http_server

from picker.config import server_limits
from picker.core import Router, RouterSettings
from picker.discovery.objects import Objective, Rewrite, load_objects
from picker.observability.metrics import PickerMetrics
from picker.protocol.server import Servers, start_servers
from picker.scheduling.profile import load_profile
from picker.signals.scraper import Scraper

log = logging.getLogger("picker")
T = TypeVar("T")
REAP_EVERY = 10.0
READINESS_EVERY = 0.2


class App:
    def __init__(self, args: Namespace):
        self.args = args
        self.metrics = PickerMetrics()
        self.router = Router(
            load_profile(args.profile),
            settings=RouterSettings(staleness=args.staleness, max_body_bytes=args.max_body_bytes,
                                    inflight_timeout=args.inflight_timeout,
                                    default_objective=args.default_objective),
            metrics=self.metrics)
        self.metrics.watch_router(self.router)
        # Static objects are read before anything starts, so a broken file fails fast and clean.
        self.static_objects = (load_objects(args.objects) if args.discovery == "static"
                               and args.objects else ([], []))
        self.scraper = Scraper(self.router, args.scrape_interval)
        self.synced = False
        self.servers: Servers | None = None
        self.metrics_server = None
        self.stop_watches = threading.Event()
        self._stopped = asyncio.Event()

    def apply(self, endpoints: list[str], objectives: list[Objective], rewrites: list[Rewrite]) -> None:
        changed = list(self.router.endpoints) != endpoints
        self.router.set_endpoints(endpoints)
        self.router.set_objects(objectives, rewrites)
        self.scraper.sync()
        if changed:
            log.info("endpoints", extra={"endpoints": endpoints})

    def _start_discovery(self) -> None:
        a = self.args
        if a.discovery == "static":
            self.apply(a.endpoints, *self.static_objects)
            self.synced = True
            return
        from picker.discovery.kubernetes import PoolState, api_watches, start_threads
        loop = asyncio.get_running_loop()

        def publish(endpoints, objectives, rewrites):
            loop.call_soon_threadsafe(self.apply, endpoints, objectives, rewrites)
            if state.is_synced and not self.synced:
                loop.call_soon_threadsafe(setattr, self, "synced", True)

        state = PoolState(a.pool_name, publish)
        start_threads(api_watches(state, a.pool_namespace), self.stop_watches)

    async def start(self) -> None:
        a = self.args
        self.servers = await start_servers(self.router, a.grpc_port, a.health_port,
                                           a.secure_serving, a.cert_path, a.request_body_mode,
                                           a.bind, limits=server_limits(a))
        host = a.bind.strip("[]") if a.bind not in ("[::]", "0.0.0.0") else ""
        self.metrics_server, _ = start_http_server(a.metrics_port, addr=host or "::",
                                                   registry=self.metrics.registry)
        await self.scraper.start()
        self._start_discovery()
        log.info("started", extra={"grpc_port": self.servers.grpc_port,
                                   "health_port": self.servers.health_port,
                                   "metrics_port": a.metrics_port, "tls": a.secure_serving,
                                   "profile": self.router.profile.name,
                                   "discovery": a.discovery})

    async def maintain(self) -> None:
        """Readiness follows discovery sync and the endpoint set; lost requests are reaped."""
        loop = asyncio.get_running_loop()
        ready = None
        next_reap = loop.time() + REAP_EVERY
        while not self._stopped.is_set():
            now_ready = self.synced and bool(self.router.endpoints)
            if now_ready != ready:
                await self.servers.set_ready(now_ready)
                ready = now_ready
                log.info("readiness", extra={"ready": ready})
            if loop.time() >= next_reap:
                lost = self.router.reap()
                if lost:
                    log.warning("reaped lost in-flight requests", extra={"count": lost})
                next_reap = loop.time() + REAP_EVERY
            try:
                await asyncio.wait_for(self._stopped.wait(), READINESS_EVERY)
            except asyncio.TimeoutError:
                pass

    def request_stop(self) -> None:
        self._stopped.set()

    async def stop(self) -> None:
        self.stop_watches.set()
        await self.scraper.close()
        if self.servers is not None:
            await self.servers.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()


async def run(args: Namespace) -> None:
    app = App(args)
    try:
        await app.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, app.request_stop)
        await app.maintain()
    finally:
        await app.stop()


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run the service's coroutine on uvloop: it cuts the event loop's share of each ext_proc
    message (grpc.aio completes every read and write through the loop); measured ~8 % less
    server CPU per decision in `make bench-picker`."""
    return uvloop.run(main)
