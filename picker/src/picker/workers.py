"""The process model of one replica: worker processes deciding, one signals process feeding them.

    python -m picker --workers N ...
      worker 0 (the main process): discovery, gRPC health, /metrics, ext_proc on the gRPC port
      workers 1..N-1: ext_proc on the same port (SO_REUSEPORT: the kernel spreads connections)
      the signals process: scrapes and parses /metrics, follows the engines' KV-cache events
                           (kvsubscriber.py), serves the outcome port (Envoy's access log
                           service, accesslog.py), relays in-flight counts and prefix-index
                           additions among the workers and, with --peer-store, with the other
                           replicas through Redis (signals_process.py, peer_store.py)

Every worker keeps a full Router: it decides alone, from its last copy of the signals. What it
sends where (in-flight counts of the endpoints it changed, prefix-index additions) and, with
flow control, the requests that arrived (counts per priority and client, for the holdback:
flowcontrol/activity.py) go to the signals process at the end of the event-loop iteration that
saw them, and on to the other workers at once: they see it within a fraction of a millisecond
when idle, and every PEER_SYNC_INTERVAL the signals process also resends the whole load table. Adding workers adds
decision throughput until the cores run out; the signals process is one more process whose
cost grows with the pool, not with the request rate (picker/README.md "Scale").
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
from argparse import Namespace
from multiprocessing.connection import Connection
from typing import Any

from picker.core import Router
from picker.flowcontrol.activity import RecentArrivals
from picker.signals.outcomes import Outcome
from picker.runtime import (apply_objects, build_flow, build_router, drain, run_loop,
                            start_ext_proc, stop_on_signals)

log = logging.getLogger("picker.workers")
MAX_MESSAGES_PER_READ = 64


class SignalsLink:
    """A worker's end of its pipe to the signals process: applies scrapes and peers' state to
    the Router, and reports the worker's own in-flight counts and prefix additions; with
    `arrivals` (the flow control's RecentArrivals) also the requests that arrived here, and
    adds the other workers' to it."""

    def __init__(self, router: Router, conn: Connection, peers: bool, on_objects=None,
                 on_closed=None, arrivals: RecentArrivals | None = None, on_replicas=None,
                 on_serving=None):
        self.router = router
        self.on_closed = on_closed
        self.on_replicas = on_replicas    # worker 0: the other replicas' states (failover.py)
        self.on_serving = on_serving      # workers 1..n-1: worker 0's role (their health)
        self.conn = conn
        self.peers = peers
        self.on_objects = on_objects
        self.scrape_batches = 0
        self.closing = False  # set on shutdown: the signals process going away is expected
        self._gone = False
        self._flush_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.arrivals = arrivals
        if peers:
            router.share_with_peers(on_change=self._schedule_flush)
        if arrivals is not None:
            arrivals.share(on_new=self._schedule_flush)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.conn.fileno(), self._on_readable)
        # uvloop (libuv) makes a watched fd non-blocking; a Connection must block, or a large
        # message that arrived in part fails to read, and a full pipe fails to write.
        os.set_blocking(self.conn.fileno(), True)

    def _schedule_flush(self) -> None:
        if not self._flush_pending and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """This worker's changed in-flight counts, prefix additions and arrivals, to the signals
        process."""
        self._flush_pending = False
        adds = self.router.take_prefix_additions()
        loads = self.router.take_changed_loads()
        arrived = self.arrivals.take_new() if self.arrivals is not None else None
        if loads or adds or arrived:
            self._send(("load", loads, adds, arrived))

    def send_objects(self, endpoints: list[str], objectives: list, rewrites: list) -> None:
        self._send(("objects", endpoints, objectives, rewrites))

    def send_role(self, acting: bool, leased: bool, leaving: bool) -> None:
        """Worker 0's heartbeat: its role, to the other replicas and workers."""
        self._send(("role", acting, leased, leaving))

    def _send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (OSError, BrokenPipeError):
            if not self.closing and not self._gone:
                log.error("signals process gone")
                self._gone = True     # said once (a heartbeat every 50 ms would repeat it)

    def _on_readable(self) -> None:
        try:
            for _ in range(MAX_MESSAGES_PER_READ):  # then back to the loop: requests first
                if not self.conn.poll():
                    break
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            if self.on_closed is not None:
                self.on_closed()
            elif not self.closing:
                log.error("signals process gone")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        r = self.router
        if kind == "scrapes":
            self.scrape_batches += 1
            for address, metrics, timed_out, at in msg[1]:
                if metrics is None:
                    r.on_scrape_failed(address, at, timed_out=timed_out)
                else:
                    r.on_metrics(address, metrics, at)
        elif kind == "models":
            for address, names in msg[1]:
                r.on_models(address, names)
        elif kind == "kv":
            r.on_kv_deltas(msg[1], msg[2])
        elif kind == "outcomes":
            debug = r.count_outcomes and log.isEnabledFor(logging.DEBUG)
            for fields in msg[1]:
                outcome = Outcome(*fields)
                r.on_outcome(outcome)
                if debug:  # once per replica, like the decision log (extproc.py)
                    log.debug("outcome", extra={f: getattr(outcome, f) for f in Outcome.__slots__})
        elif kind == "peers":
            r.set_peer_loads(msg[1], partial=msg[3])
            r.add_peer_prefixes(msg[2])
            if msg[4] and self.arrivals is not None:
                self.arrivals.add_peers(*msg[4])
        elif kind == "objects" and self.on_objects is not None:
            self.on_objects(msg[1], msg[2], msg[3])
        elif kind == "replicas" and self.on_replicas is not None:
            self.on_replicas(msg[1])
        elif kind == "serving" and self.on_serving is not None:
            self.on_serving(msg[1])

    async def close(self) -> None:
        self.closing = True
        try:
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        except (ValueError, OSError):
            pass
        try:
            self._send(("stop",))
        finally:
            self.conn.close()


def outcome_settings(args: Namespace) -> dict | None:
    """Where the signals process serves the outcome port (accesslog.start_server), None when
    --outcomes-port is 0."""
    port = getattr(args, "outcomes_port", 0)
    if not port:
        return None
    return {"port": port, "host": args.bind, "secure": args.secure_serving,
            "cert_path": args.cert_path}


def start_signals_process(args: Namespace, workers: int, kv: dict | None = None,
                          link: dict | None = None
                          ) -> tuple[mp.process.BaseProcess, list[Connection]]:
    """The signals process and one connection per worker (index = worker number); with `kv`
    (app.kv_settings) it subscribes to the engines' KV-cache events; with --outcomes-port it
    serves Envoy's access log service there; with `link` (app._link_settings) it runs the peer
    link to the other replicas."""
    from picker import signals_process
    ctx = mp.get_context("spawn")
    ours, theirs = zip(*(ctx.Pipe(duplex=True) for _ in range(workers)))
    proc = ctx.Process(target=signals_process.main, name="picker-signals",
                       args=(list(theirs), args.scrape_interval, args.staleness, args.log_level,
                             getattr(args, "peer_store", None),
                             f"{getattr(args, 'pool_namespace', 'default')}/"
                             f"{getattr(args, 'pool_name', 'pool')}", kv,
                             outcome_settings(args), link),
                       daemon=True)
    proc.start()
    for c in theirs:
        c.close()
    return proc, list(ours)


def start_workers(args: Namespace, grpc_port: int, conns: list[Connection]) -> list[mp.process.BaseProcess]:
    """Workers 1..n-1 (conns[i-1] is worker i's), serving ext_proc on grpc_port."""
    ctx = mp.get_context("spawn")
    procs = []
    for i, conn in enumerate(conns, start=1):
        p = ctx.Process(target=worker_main, name=f"picker-worker-{i}",
                        args=(args, i, grpc_port, conn), daemon=True)
        p.start()
        conn.close()
        procs.append(p)
    return procs


def worker_main(args: Namespace, index: int, grpc_port: int, conn: Connection) -> None:
    """An extra worker: a Router and the ext_proc server, fed by the signals process."""
    from picker.observability.logs import setup_logging
    setup_logging(args.log_level)

    async def main():
        router = build_router(args, index)
        flow = build_flow(args, router)
        stop, closed = asyncio.Event(), asyncio.Event()
        servers = None

        def serving(acting: bool) -> None:
            if servers is not None:
                asyncio.ensure_future(servers.set_ready(acting))

        def closing() -> None:
            closed.set()
            stop.set()
        link = SignalsLink(router, conn, peers=True,
                           on_objects=lambda *objects: apply_objects(router, *objects),
                           on_closed=closing, arrivals=flow.arrivals if flow else None,
                           on_serving=serving)
        link.start()
        servers = await start_ext_proc(router, args, grpc_port, 0, flow)
        stop_on_signals(stop.set)
        log.info("worker started", extra={"worker": index, "pid": os.getpid()})
        await stop.wait()
        if not closed.is_set():
            # Stopped by a signal (worker 0 sends SIGTERM after its own drain; a signal to the
            # whole group reaches every worker at once): answer what Envoy still sends first.
            await drain(servers, args)
        await servers.stop()
        await link.close()
    run_loop(main())
