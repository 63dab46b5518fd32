"""Wire discovery -> signals -> scheduling -> core -> protocol and run until SIGTERM/SIGINT.

Worker 0 of the replica's process model (workers.py): discovery, health, /metrics and ext_proc
here; scraping in the signals process; more ext_proc workers with --workers. With
--leader-election and --peers, also the replica's role (failover.py): whether its health checks
say SERVING to Envoy, from the Lease (leader.py) and the other replicas' states on the peer link
(peer_link.py, in the signals process).

On SIGTERM: hand over (NOT_SERVING, "leaving" on the peer link, the Lease released), then still
answer what Envoy sends for --drain-seconds (until its health check has seen NOT_SERVING), then
stop the servers: held requests are sent, answered streams end cleanly (protocol/server.py).
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
from picker.failover import TAKEOVER_REASONS, Failover, LeaseView, PeerState, Role
from picker.protocol.server import Servers
from picker.protocol.tls import self_signed
from picker.runtime import (apply_objects, build_flow, build_router, drain, start_ext_proc,
                            stop_on_signals)
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
        self.peers: list[tuple[str, int]] = getattr(args, "peers", None) or []
        from picker.leader import default_identity
        self.identity = self.lease.identity if self.lease is not None else default_identity()
        self.failover = (Failover(self.identity, linked=bool(self.peers))
                         if self.lease is not None or self.peers else None)
        self.peer_states: list[PeerState] = []
        self.stopping = False
        self.failed: str | None = None   # why it stopped by itself (the exit status is then 1)
        self.ready: bool | None = None   # what the health services say now
        self._warm: bool | None = None
        self._heartbeat: asyncio.Task | None = None

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
                                                         kv_settings(a, self.router),
                                                         self._link_settings())
        shared = self.workers > 1
        self.link = SignalsLink(self.router, conns[0],
                                peers=shared or bool(getattr(a, "peer_store", None) or self.peers),
                                arrivals=self.flow.arrivals if shared and self.flow else None,
                                on_replicas=self._on_replicas, on_closed=self._signals_gone)
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
        if self.peers:
            self._heartbeat = asyncio.create_task(self._beat())
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

    def _link_settings(self) -> dict | None:
        """What the signals process needs for the peer link (--peers), else None."""
        if not self.peers:
            return None
        return {"identity": self.identity, "listen": (self.args.bind, self.args.peer_port),
                "peers": self.peers}

    def _signals_gone(self) -> None:
        """The signals process died: no more scrapes, KV events or peer link (the other replicas
        saw the link close and one of them acts now). Stop; the exit status says why, and the
        kubelet restarts the container."""
        if self.link is not None and self.link.closing:
            return
        log.error("signals process gone: stopping")
        self.failed = "signals process gone"
        self.request_stop()

    def _on_replicas(self, states: list[PeerState]) -> None:
        self.peer_states = states
        self._wake.set()

    def role(self) -> Role:
        """This replica's role now (failover.py); without --leader-election and --peers it
        serves whenever it is warm."""
        warm = self.warm()
        if self.failover is None:
            return Role(warm and not self.stopping, False, "no leader election")
        view = None
        if self.lease is not None:
            view = self.elector.view() if self.elector is not None else LeaseView(
                False, None, False, 0.0, self.lease.retry_period)
        return self.failover.update(warm, self.stopping, view, self.peer_states)

    async def _apply_role(self) -> Role:
        """Health follows the role; the peer link hears of a change at once."""
        before = self.failover.role if self.failover is not None else None
        role = self.role()
        warm = self.warm()
        if warm != self._warm:
            await self.servers.set_warm(warm)
            self._warm = warm
        if self.elector is not None:
            self.elector.candidate = role.candidate
            if role.acting and role.without_lease and not (before and before.acting):
                self.elector.poke()   # took over: try for the Lease now (released at once on
                #                       a handover, else after its duration)
        if role.acting != self.ready:
            await self.servers.set_ready(role.acting)
            self.ready = role.acting
            self._send_role()
            log.info("readiness", extra={"ready": role.acting, "reason": role.reason,
                                         "warm": self.warm(), "identity": self.identity})
        if role.reason in TAKEOVER_REASONS and (before is None or before.reason != role.reason):
            log.warning("took over", extra={"reason": role.reason, "identity": self.identity,
                                            "from": self.failover.took_over_from})
        return role

    def _send_role(self) -> None:
        """To the signals process: the other workers' health follows it, and with --peers it is
        the heartbeat to the other replicas."""
        if self.link is not None:
            leased = self.elector is not None and self.elector.is_leader()
            self.link.send_role(bool(self.ready), leased, self.stopping)

    async def _beat(self) -> None:
        """The heartbeat on the peer link: this process's role, every peer_link.HEARTBEAT (a
        worker 0 that hangs stops it, and the other replicas see it fall silent)."""
        from picker.peer_link import HEARTBEAT
        while True:
            self._send_role()
            await asyncio.sleep(HEARTBEAT)

    def warm(self) -> bool:
        """Discovery synced, an endpoint known, and scraped (see _scraped): what a standby keeps
        up too, so that it can serve the moment it leads."""
        return self.synced and bool(self.router.endpoints) and self._scraped()

    async def maintain(self) -> None:
        """Readiness follows discovery sync, the endpoint set, the first scrapes and, with
        --leader-election and --peers, the role (failover.py); lost requests are reaped."""
        loop = asyncio.get_running_loop()
        next_reap = loop.time() + REAP_EVERY
        while not self._stopped.is_set():
            await self._apply_role()
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
        from picker.observability.metrics import FailoverCollector
        registry.register(FailoverCollector(lambda: self.failover, lambda: self.peer_states,
                                            lambda: bool(self.ready)))
        return registry

    async def release_lease(self) -> None:
        """Not ready, and the Lease given up at once, so a standby takes over within one retry
        period (at once with --peers: it hears this replica leave) while this replica finishes
        the streams it has."""
        if self._election is None:
            return
        if self.servers is not None:
            await self.servers.set_ready(False)
        self._stop_election.set()
        self.elector.poke()
        await asyncio.to_thread(self._election.join, 2 * self.lease.request_timeout + 1)

    async def hand_over(self) -> bool:
        """Stop acting: NOT_SERVING on every health service, "leaving" on the peer link (a warm
        standby acts at once), the Lease released. True if this replica was serving Envoy."""
        was_serving = bool(self.ready)
        self.stopping = True
        if self.servers is not None:
            await self._apply_role()
        self._send_role()
        await self.release_lease()
        return was_serving

    async def stop(self) -> None:
        was_serving = await self.hand_over()
        for p in self.worker_procs:
            p.terminate()  # they drain too, meanwhile (workers.py)
        if was_serving and self.servers is not None:
            await drain(self.servers, self.args)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self.stop_watches.set()
        if self.link is not None:
            self.link.closing = True
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
    if app.failed:
        raise SystemExit(1)
