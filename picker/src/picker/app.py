"""Wire discovery -> signals -> scheduling -> core -> protocol and run until SIGTERM/SIGINT.

Worker 0 of the replica's process model (workers.py): discovery, health, /metrics and ext_proc
here; scraping in the signals process; more ext_proc workers with --workers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from pathlib import Path
from argparse import Namespace

from prometheus_client import CollectorRegistry, start_http_server

from picker import defaults
from picker.config import lease_settings
from picker.core import Router
from picker.discovery.objects import Objective, Rewrite, load_objects
from picker.protocol.server import Servers
from picker.protocol.tls import self_signed
from picker.runtime import apply_objects, build_flow, build_router, start_ext_proc, stop_on_signals
from picker.workers import SignalsLink, start_signals_process, start_workers

log = logging.getLogger("picker")
REAP_EVERY = defaults.REAP_EVERY
READINESS_EVERY = defaults.READINESS_EVERY
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def kv_settings(args: Namespace, router: Router) -> dict | None:
    """What the signals process needs to subscribe to the engines' KV-cache events, or None
    when precise routing is off or has no tokenizer."""
    if router.precise is None or not router.precise.active:
        return None
    return {"events_port": args.kv_events_port, "replay_port": args.kv_replay_port}


class App:
    def __init__(self, args: Namespace):
        self.args = args
        self.router = build_router(args)
        self.flow = build_flow(args, self.router)
        self.metrics = self.router.metrics
        self.metrics.watch_router(self.router)
        # Static objects are read before anything starts, so a broken file fails fast and clean.
        self.static_objects = (load_objects(args.objects) if args.discovery == "static"
                               and args.objects else ([], []))
        self.workers = getattr(args, "workers", defaults.WORKERS)
        self.signals_proc = None
        self.link: SignalsLink | None = None
        self.worker_procs: list = []
        self._tls_dir: tempfile.TemporaryDirectory | None = None
        self.synced = False
        self.servers: Servers | None = None
        self.metrics_server = None
        self.stop_watches = threading.Event()
        self.lease = lease_settings(args)
        self.elector = None
        self._election: threading.Thread | None = None
        self._stop_election = threading.Event()
        self._stopped = asyncio.Event()
        self._wake = asyncio.Event()  # readiness to be checked now (a leadership change, stop)

    def apply(self, endpoints: list[str], objectives: list[Objective], rewrites: list[Rewrite]) -> None:
        changed = apply_objects(self.router, endpoints, objectives, rewrites)
        if self.link is not None:
            self.link.send_objects(endpoints, objectives, rewrites)
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
        if self.workers > 1 and a.secure_serving and not a.cert_path:
            self._share_self_signed_certificate()
        self.signals_proc, conns = start_signals_process(a, self.workers,
                                                         kv_settings(a, self.router))
        shared = self.workers > 1
        self.link = SignalsLink(self.router, conns[0],
                                peers=shared or bool(getattr(a, "peer_store", None)),
                                arrivals=self.flow.arrivals if shared and self.flow else None)
        self.link.start()
        self.servers = await start_ext_proc(self.router, a, a.grpc_port, a.health_port, self.flow)
        if self.workers > 1:
            self.worker_procs = start_workers(a, self.servers.grpc_port, conns[1:])
        host = a.bind.strip("[]") if a.bind not in ("[::]", "0.0.0.0") else ""
        self.metrics_server, _ = start_http_server(a.metrics_port, addr=host or "::",
                                                   registry=self._watch_leader(
                                                       self._metrics_registry()))
        self._start_discovery()
        self._start_election()
        log.info("started", extra={"grpc_port": self.servers.grpc_port,
                                   "health_port": self.servers.health_port,
                                   "metrics_port": a.metrics_port, "tls": a.secure_serving,
                                   "profile": self.router.profile.name,
                                   "discovery": a.discovery})

    def _start_election(self) -> None:
        """With --leader-election: compete for the Lease in a thread of its own (blocking API
        calls), once warm; a change of leadership wakes the readiness loop."""
        if self.lease is None:
            return
        from picker.leader import start_elector
        loop = asyncio.get_running_loop()
        self.elector, self._election = start_elector(
            self.lease, lambda leading: loop.call_soon_threadsafe(self._wake.set),
            self._stop_election, candidate=self.warm())

    def leading(self) -> bool:
        """This replica may serve Envoy: it holds the Lease, or runs without leader election."""
        return self.elector is None and self.lease is None or (
            self.elector is not None and self.elector.is_leader())

    def warm(self) -> bool:
        """Discovery synced, an endpoint known, and scraped (see _scraped): what a standby keeps
        up too, so that it can serve the moment it leads."""
        return self.synced and bool(self.router.endpoints) and self._scraped()

    async def maintain(self) -> None:
        """Readiness follows discovery sync, the endpoint set, the first scrapes and, with
        --leader-election, the Lease; lost requests are reaped."""
        loop = asyncio.get_running_loop()
        ready = None
        next_reap = loop.time() + REAP_EVERY
        while not self._stopped.is_set():
            warm, leading = self.warm(), self.leading()
            if self.elector is not None:
                self.elector.candidate = warm  # competes for the Lease only once warm
            now_ready = warm and leading
            if now_ready != ready:
                await self.servers.set_ready(now_ready)
                ready = now_ready
                log.info("readiness", extra={"ready": ready, "warm": warm, "leader": leading})
            if loop.time() >= next_reap:
                lost = self.router.reap()
                if lost:
                    log.warning("reaped lost in-flight requests", extra={"count": lost})
                next_reap = loop.time() + REAP_EVERY
            try:
                await asyncio.wait_for(self._wake.wait(), READINESS_EVERY)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _scraped(self) -> bool:
        """An endpoint is ready, or every endpoint has been scraped once (failures included): the
        signals process starts a moment after this one, and until its first results the picker
        could only answer 503."""
        r = self.router
        return r.ready or all(e.metrics is not None or e.scrape_errors for e in r.endpoints.values())

    def request_stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _share_self_signed_certificate(self) -> None:
        """Every worker must present the same certificate: make one, hand them its directory."""
        self._tls_dir = tempfile.TemporaryDirectory(prefix="picker-tls-")
        key, cert = self_signed()
        d = Path(self._tls_dir.name)
        (d / "tls.key").write_bytes(key)
        (d / "tls.crt").write_bytes(cert)
        os.chmod(d / "tls.key", 0o600)
        self.args.cert_path = str(d)

    def _metrics_registry(self) -> CollectorRegistry:
        """This process's registry; with several workers, every worker's counters and histograms
        summed (prometheus_client's multiprocess mode, set up by __main__) plus this router's
        per-endpoint gauges."""
        if self.workers <= 1 or not os.environ.get(MULTIPROC_ENV):
            return self.metrics.registry
        from prometheus_client import multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        self.metrics.watch_router(self.router, registry)
        return registry

    def _watch_leader(self, registry: CollectorRegistry) -> CollectorRegistry:
        if self.lease is not None:
            from picker.observability.metrics import LeaderCollector
            registry.register(LeaderCollector(lambda: self.elector))
        return registry

    async def release_lease(self) -> None:
        """Not ready, and the Lease given up at once, so a standby takes over within one retry
        period while this replica finishes the streams it has."""
        if self._election is None:
            return
        if self.servers is not None:
            await self.servers.set_ready(False)
        self._stop_election.set()
        await asyncio.to_thread(self._election.join, 2 * self.lease.request_timeout + 1)

    async def stop(self) -> None:
        await self.release_lease()
        self.stop_watches.set()
        if self.link is not None:
            self.link.closing = True
        for p in self.worker_procs:
            p.terminate()
        for p in self.worker_procs:
            await asyncio.to_thread(p.join, 5)
        if self.servers is not None:
            await self.servers.stop()
        if self.link is not None:
            await self.link.close()
        if self.signals_proc is not None:
            await asyncio.to_thread(self.signals_proc.join, 5)
            if self.signals_proc.is_alive():
                self.signals_proc.terminate()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self._tls_dir is not None:
            self._tls_dir.cleanup()


async def run(args: Namespace) -> None:
    app = App(args)
    try:
        await app.start()
        stop_on_signals(app.request_stop)
        await app.maintain()
    finally:
        await app.stop()
