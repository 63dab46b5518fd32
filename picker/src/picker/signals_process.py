"""The signals process: every signal intake of a replica, off the decision path.

A driver beside app.py, in its own process (so its CPU never competes with decisions for the
GIL): it scrapes and parses every endpoint's /metrics (scraper.py) and relays what the worker
processes need to share. The workers only apply the results to their Routers.

    workers --("objects", endpoints, objectives, rewrites)--> signals   (from worker 0 only)
    workers --("load", {address: load}, prefix adds, arrivals)--> signals   (as they decide:
              changed endpoints only; arrivals: (at, {(priority, client): n}) or None, the
              requests held or decided since the last message, for flow control's holdback)
    signals --("objects", ...)--> workers 1..n-1
    signals --("scrapes", [(address, metrics | None, timed_out, at)])--> every worker
    signals --("models", [(address, names listed in /v1/models)])--> every worker
    signals --("kv", index deltas, per-endpoint status or None)--> every worker   (with precise
              routing: the engines' KV-cache events, followed here; kvsubscriber.py)
    signals --("outcomes", [Outcome field tuples])--> every worker   (with --outcomes-port: the
              requests Envoy's access log service reported as completed; accesslog.py)
    signals --("peers", {address: summed load of the others}, their prefix adds, partial,
              arrivals)--> the other workers at once (partial: the changed endpoints; the
              sender's arrivals as it sent them), and every PEER_SYNC_INTERVAL each worker the
              whole table (no arrivals: each worker keeps its own window of them)

With --peer-store, the workers' changes also go to the other replicas through Redis, and theirs
come back the same way (peer_store.py): added to what each worker gets in "peers", at once. With
--peers, the same goes over the replicas' direct link instead (peer_link.py), which also carries
the heartbeats and claims failover.py decides on:

    worker 0 --("role", acting, leased, leaving)--> signals   (every peer_link.HEARTBEAT, and on a
              change: sent on to the other replicas at once as the heartbeat)
    signals --("serving", acting)--> workers 1..n-1   (on a change: their ext_proc port's health)
    signals --("replicas", [failover.PeerState])--> worker 0   (on a change of any peer's state)

and the outcomes Envoy's access log sends this replica go to the other replicas too, theirs come
back into "outcomes" here: every replica learns from every outcome, whichever one Envoy sent it
to (the gateway sends the access log to the picker Service's Ready pod, the acting leader).

Messages are pickled over one Pipe per worker. The signals process sends from one thread per
worker, so a worker busy deciding never blocks it (and so never blocks the other workers).
Timestamps are time.monotonic(), the same clock in every process of the machine.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from picker import defaults
from picker.signals.metrics import MetricsParseError, parse_vllm_metrics
from picker.signals.state import ZERO_LOAD, Load, merge_loads, subtract_load

log = logging.getLogger("picker.signals")
FLUSH_EVERY = 0.01   # seconds: scrape results reach the workers within this
FINISHED_AT = 10     # index of Outcome.finished_at in an outcome's fields (signals/outcomes.py)


class _Sender:
    """A worker's pipe, written from its own thread (pickling and blocking there)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.queue.put(msg)

    def _run(self) -> None:
        while True:
            msg = self.queue.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                return


class Collector:
    """The scraper's sink: parses pages here and batches the results for the workers."""

    def __init__(self):
        self.endpoints: list[str] = []
        self.on_metrics = None  # with precise routing: capacity and activity to the KV tracker
        self.batch: list[tuple[str, Any, bool, float]] = []
        self.models: list[tuple[str, tuple[str, ...]]] = []  # (address, names in /v1/models)

    def on_models(self, address: str, names) -> None:
        self.models.append((address, tuple(names)))

    def on_scrape_ok(self, address: str, text: str) -> None:
        try:
            metrics = parse_vllm_metrics(text)
        except MetricsParseError:
            self.batch.append((address, None, False, time.monotonic()))
            raise
        self.batch.append((address, metrics, False, time.monotonic()))
        if self.on_metrics is not None:
            self.on_metrics(address, metrics.num_gpu_blocks, metrics.block_size,
                            metrics.prompt_tokens_computed)

    def on_scrape_failed(self, address: str, timed_out: bool = False) -> None:
        self.batch.append((address, None, timed_out, time.monotonic()))


class SignalsHub:
    def __init__(self, conns: list[Connection], interval: float, staleness: float,
                 peer_store: str | None = None, pool: str = "pool", kv: dict | None = None,
                 outcomes: dict | None = None, link: dict | None = None):
        self.conns = conns
        self.outcome_settings = outcomes  # accesslog.start_server's port, host, secure, cert_path
        self.outcome_server = None
        self.outcomes: list[tuple] = []  # received, not yet sent to the workers
        self.peers = None
        self.link = None
        self._serving: bool | None = None
        if peer_store:
            from picker.peer_store import RedisPeers
            self.peers = RedisPeers(peer_store, pool, on_remote=self._on_remote)
        elif link:
            from picker.peer_link import PeerLink
            self.peers = self.link = PeerLink(link["identity"], pool, tuple(link["listen"]),
                                              link["peers"], on_remote=self._on_remote,
                                              on_peers=self._on_peer_states,
                                              on_outcomes=self._on_peer_outcomes)
        self.senders = [_Sender(c) for c in conns]
        self.base_interval = interval
        self.staleness = staleness
        self.collector = Collector()
        self.loads: list[dict[str, Load]] = [{} for _ in conns]
        self._kv_status = None

        self.stopped = asyncio.Event()
        from picker.scraper import Scraper  # aiohttp only in this process
        self.scraper = Scraper(self.collector, interval)
        self.kv = None
        if kv is not None:
            from picker.kvsubscriber import KVSources, KVSubscriber  # pyzmq only here
            self.kv = KVSubscriber()
            self.kv_sources = KVSources(self.kv, kv["events_port"], kv["replay_port"])
            self.collector.on_metrics = self.kv.on_metrics

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for i, conn in enumerate(self.conns):
            loop.add_reader(conn.fileno(), self._on_readable, i)
            os.set_blocking(conn.fileno(), True)  # libuv made it non-blocking (see workers.py)
        await self.scraper.start()
        await self._start_outcomes()
        if self.kv is not None:
            self.kv.start()
            await self.kv_sources.start()
        if self.peers is not None:
            await self.peers.start()
        next_peers = loop.time()
        try:
            while not self.stopped.is_set():
                self._flush_scrapes()
                if (len(self.conns) > 1 or self.peers) and loop.time() >= next_peers:
                    self._send_peers()
                    next_peers = loop.time() + defaults.PEER_SYNC_INTERVAL
                try:
                    await asyncio.wait_for(self.stopped.wait(), FLUSH_EVERY)
                except asyncio.TimeoutError:
                    pass
        finally:
            for conn in self.conns:
                loop.remove_reader(conn.fileno())
            await self.scraper.close()
            if self.outcome_server is not None:
                await self.outcome_server.stop(0)
            if self.kv is not None:
                await self.kv_sources.close()
                self.kv.stop()
            if self.peers is not None:
                await self.peers.close()
            for s in self.senders:
                s.send(None)

    async def _start_outcomes(self) -> None:
        """The access log server (accesslog.py). A port that cannot be bound is logged and left
        off: routing does not depend on it."""
        if not self.outcome_settings:
            return
        from picker.accesslog import start_server  # grpc only where outcomes are on
        try:
            self.outcome_server, port, _ = await start_server(self._on_outcomes,
                                                              **self.outcome_settings)
        except (RuntimeError, OSError, ValueError) as exc:
            log.error("outcome port not served", extra={"error": str(exc),
                                                        "port": self.outcome_settings["port"]})
            return
        log.info("outcome port", extra={"port": port})

    def _on_outcomes(self, batch: list[tuple]) -> None:
        self.outcomes.extend(batch)  # sent with the next flush (FLUSH_EVERY)
        if self.link is not None:    # the other replicas learn from them too
            self.link.publish_outcomes(batch)

    def _on_peer_outcomes(self, batch: list[tuple]) -> None:
        """Another replica's outcomes, as if Envoy had sent them here: received now, by this
        process's clock (the sender's monotonic clock means nothing here)."""
        now = time.monotonic()
        self.outcomes.extend(o[:FINISHED_AT] + (now,) + o[FINISHED_AT + 1:] for o in batch)

    def _on_readable(self, i: int) -> None:
        conn = self.conns[i]
        try:
            for _ in range(256):  # then back to the loop, so one busy worker starves nothing
                if not conn.poll():
                    break
                self._handle(i, conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
            self.loads[i] = {}
            if i == 0:  # worker 0 (the main process) went away: the replica is gone
                self.stopped.set()

    def _handle(self, i: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "objects":
            endpoints = msg[1]
            self.collector.endpoints = endpoints
            interval = defaults.scrape_interval_for(len(endpoints), self.base_interval, self.staleness)
            self.scraper.set_interval(interval)
            if self.link is not None:   # a gone peer's recent requests: in our next scrape
                self.link.gone_hold = 2 * interval
            self.scraper.sync()
            if self.kv is not None:
                self.kv_sources.sync(endpoints)
            for j, s in enumerate(self.senders):
                if j != i:
                    s.send(msg)
        elif kind == "load":
            self._on_load(i, msg[1], msg[2], msg[3])
        elif kind == "role":
            self._on_role(*msg[1:])
        elif kind == "stop":
            self.stopped.set()

    def _on_role(self, acting: bool, leased: bool, leaving: bool) -> None:
        """Worker 0's role: the heartbeat to the other replicas, and to the other workers
        whether their ext_proc port's health says SERVING."""
        if self.link is not None:
            self.link.send_role(acting, leased, leaving)
        if acting != self._serving:
            self._serving = acting
            for s in self.senders[1:]:
                s.send(("serving", acting))

    def _on_peer_states(self, states: list) -> None:
        self.senders[0].send(("replicas", states))

    def _flush_scrapes(self) -> None:
        if self.kv is not None:
            deltas, status = self.kv.take()
            fresh = status if status is not self._kv_status else None
            if deltas or fresh is not None:
                self._kv_status = status
                msg = ("kv", deltas, fresh)
                for s in self.senders:
                    s.send(msg)
        if self.outcomes:
            msg, self.outcomes = ("outcomes", self.outcomes), []
            for s in self.senders:
                s.send(msg)
        if self.collector.models:
            models, self.collector.models = self.collector.models, []
            for s in self.senders:
                s.send(("models", models))
        batch = self.collector.batch
        if not batch:
            return
        self.collector.batch = []
        msg = ("scrapes", batch)
        for s in self.senders:
            s.send(msg)

    def _on_load(self, i: int, changed: dict[str, Load], adds: list, arrivals=None) -> None:
        """Worker i's changed counts, prefix additions and arrivals: merged, and passed on at
        once."""
        mine = self.loads[i]
        for addr, load in changed.items():
            if load == ZERO_LOAD:
                mine.pop(addr, None)
            else:
                mine[addr] = load
        remote = {}
        if self.peers is not None:
            local = merge_loads(self.loads, changed)
            self.peers.publish_changes(local, adds)
            remote = self.peers.remote_loads(changed)
        self._forward(changed, remote, adds, skip=i, arrivals=arrivals)

    def _on_remote(self, remote: dict[str, Load], adds: list) -> None:
        """Another replica's changes (peer_store.py): passed on to every worker at once."""
        self._forward(remote, remote, adds, skip=None)

    def _forward(self, addresses, remote: dict[str, Load], adds: list, skip: int | None,
                 arrivals=None) -> None:
        """To each worker but `skip`: the others' sums for `addresses`, `adds` and `arrivals`."""
        for j, s in enumerate(self.senders):
            if j == skip:
                continue
            tables = [loads for k, loads in enumerate(self.loads) if k != j]
            s.send(("peers", merge_loads([*tables, remote], addresses), adds, True, arrivals))

    def _send_peers(self) -> None:
        """The whole table: to the other replicas (their heartbeat from us) and to each worker."""
        remote = {}
        if self.peers is not None:
            self.peers.publish_table(merge_loads(self.loads))
            remote = self.peers.remote_loads()
        total = merge_loads([*self.loads, remote])
        for i, s in enumerate(self.senders):
            own = self.loads[i]
            others = {addr: subtract_load(t, own.get(addr, ZERO_LOAD)) for addr, t in total.items()}
            s.send(("peers", others, [], False, None))


def main(conns: list[Connection], interval: float, staleness: float, log_level: str,
         peer_store: str | None = None, pool: str = "pool", kv: dict | None = None,
         outcomes: dict | None = None, link: dict | None = None) -> None:
    """Entry point of the signals process (multiprocessing spawn target)."""
    import signal
    from picker.observability.logs import setup_logging
    setup_logging(log_level)
    # Worker 0 decides when this process ends ("stop", or its pipe closing): a SIGTERM sent to the
    # whole process group (Ctrl-C, `kill -- -PGID`) must not cut the peer link before worker 0
    # has told the other replicas that it leaves.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import uvloop
    hub = SignalsHub(conns, interval, staleness, peer_store, pool, kv, outcomes, link)
    try:
        uvloop.run(hub.run())
    except KeyboardInterrupt:
        pass
