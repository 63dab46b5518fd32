"""Subscriptions to every endpoint's KV-cache events, in the signals process (off the deciding
loop). A driver, like scraper.py: I/O here, the logic in signals/kvstate.py.

One thread owns every ZMQ socket and the KVTracker: per endpoint a SUB socket on its publisher
and, while a replay runs, a DEALER on its replay socket (protocol: signals/kvevents.py). Other
threads talk to it through a command queue (endpoints, scraped metrics) and take the index
changes it produced (take()). Every picker replica subscribes on its own.

Where an endpoint publishes: `GET /kv_event_sources` on the endpoint (vLLM's own answer, rank 0;
a wildcard host is the endpoint's host), else its host with the fixed ports
(--kv-events-port, --kv-replay-port).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

import zmq

from picker import defaults
from picker.signals.kvevents import KVEventsError, decode_seq, replay_request, split_replay
from picker.signals.kvstate import KVTracker

log = logging.getLogger("picker.kvevents")
STOPPED = "subscriber_stopped"  # fallback reason: the subscriber thread failed
POLL_MS = 20
MAX_PER_READ = 256          # messages read from one socket before the others get a turn
MAX_REPLAY_MESSAGES = 20000  # vLLM buffers 10,000 batches by default
RECONNECT_AFTER = 0.5        # seconds after a dropped connection


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def resolve_source(address: str, sources: Any) -> tuple[str, str | None] | None:
    """(publisher URL, replay URL) from a /kv_event_sources answer for this endpoint (rank 0, or
    the lowest rank), a wildcard host replaced by the endpoint's host; None if unusable."""
    if not isinstance(sources, dict) or not sources:
        return None
    ranks = sorted(sources, key=lambda k: (not str(k).isdigit(), int(k) if str(k).isdigit() else 0))
    cfg = sources[ranks[0]]
    if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
        return None

    def fix(url: str | None) -> str | None:
        if not isinstance(url, str) or not url.startswith("tcp://"):
            return None
        host, _, port = url[6:].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::", "") or host.startswith("localhost"):
            host = _host(address)
        return tcp(host, int(port)) if port.isdigit() else None

    pub = fix(cfg["endpoint"])
    return (pub, fix(cfg.get("replay_endpoint"))) if pub else None


class _Sub:
    __slots__ = ("address", "pub_url", "replay_url", "sock", "monitor", "reconnect_at", "dealer",
                 "replay_start", "replayed")

    def __init__(self, address: str, pub_url: str, replay_url: str | None):
        self.address = address
        self.pub_url = pub_url
        self.replay_url = replay_url
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.reconnect_at: float | None = None
        self.dealer: zmq.Socket | None = None
        self.replay_start = 0
        self.replayed: list[tuple[int, bytes]] = []


class KVSubscriber:
    def __init__(self, tracker: KVTracker | None = None,
                 max_message_bytes: int = defaults.KV_MAX_MESSAGE_BYTES,
                 rcvhwm: int = 10 * defaults.KV_MAX_PENDING):
        self.tracker = tracker or KVTracker()
        self.max_message_bytes = max_message_bytes
        self.rcvhwm = rcvhwm
        self.ctx = zmq.Context()
        # a SUB and its monitor per endpoint, a DEALER while replaying: past libzmq's default
        # of 1,023 sockets at 1,024 endpoints
        self.ctx.set(zmq.MAX_SOCKETS, 16384)
        self.subs: dict[str, _Sub] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._deltas: list = []
        self._status: dict[str, tuple] = {}
        self._next_status = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.bad_frames = 0

    # ---- from other threads ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def subscribe(self, address: str, pub_url: str, replay_url: str | None) -> None:
        self._commands.put(("subscribe", address, pub_url, replay_url))

    def unsubscribe(self, address: str) -> None:
        self._commands.put(("unsubscribe", address))

    def on_metrics(self, address: str, num_gpu_blocks, block_size, computed) -> None:
        self._commands.put(("metrics", address, num_gpu_blocks, block_size, computed))

    def take(self) -> tuple[list, dict[str, tuple]]:
        """The index changes since the last call, and every endpoint's status (metrics)."""
        with self._lock:
            deltas, self._deltas = self._deltas, []
            return deltas, self._status

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._commands_due(poller)
                ready = dict(poller.poll(POLL_MS)) if self.subs else {}
                if not self.subs:
                    self._stop.wait(POLL_MS / 1000)
                now = time.monotonic()
                for sub in list(self.subs.values()):
                    if sub.monitor is not None and sub.monitor in ready:
                        self._on_monitor(sub, poller, now)
                    if sub.reconnect_at is not None and now >= sub.reconnect_at:
                        self._connect(sub, poller)
                    if sub.sock is not None and sub.sock in ready:
                        self._read_live(sub, now)
                    if sub.dealer is not None and sub.dealer in ready:
                        self._read_replay(sub, poller, now)
                self._replays_due(poller, time.monotonic())
                self._publish()
        except Exception:  # never silently: the replica then routes approximately
            log.exception("KV-events subscriber stopped: every endpoint falls back")
            self.tracker.fall_back_all(STOPPED, "the subscriber stopped", time.monotonic())
            self._next_status = 0.0
            self._publish()
        finally:
            for sub in self.subs.values():
                self._close(sub, poller)
            self.ctx.term()

    def _commands_due(self, poller: zmq.Poller) -> None:
        t = self.tracker
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind, address = cmd[0], cmd[1]
            if kind == "subscribe":
                old = self.subs.get(address)
                if old is not None and (old.pub_url, old.replay_url) == (cmd[2], cmd[3]):
                    continue
                if old is not None:
                    self._close(old, poller)
                    t.remove(address)
                sub = self.subs[address] = _Sub(address, cmd[2], cmd[3])
                self._connect(sub, poller)
                t.add(address, time.monotonic(), replay=True)
                log.info("KV events: subscribed", extra={"endpoint": address, "publisher": cmd[2],
                                                         "replay": cmd[3]})
            elif kind == "unsubscribe":
                sub = self.subs.pop(address, None)
                if sub is not None:
                    self._close(sub, poller)
                t.remove(address)
            elif kind == "metrics":
                t.set_capacity(address, cmd[2], cmd[3])
                t.on_activity(address, cmd[4], time.monotonic())

    def _socket(self, kind: int, url: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # a huge message: dropped
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)                  # beyond it: a gap, replayed
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        if "[" in url:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(url)
        return sock

    def _connect(self, sub: _Sub, poller: zmq.Poller) -> None:
        """A SUB on the publisher, and a monitor: libzmq does not reconnect a connection it
        dropped itself (a message over MAXMSGSIZE), so a disconnect makes a new socket here.
        Batches lost meanwhile show as a sequence gap at the next one, and are replayed."""
        sub.sock = self._socket(zmq.SUB, sub.pub_url)
        sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
        sub.monitor = sub.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(sub.sock, zmq.POLLIN)
        poller.register(sub.monitor, zmq.POLLIN)
        sub.reconnect_at = None

    def _close_live(self, sub: _Sub, poller: zmq.Poller) -> None:
        for s in (sub.monitor, sub.sock):
            if s is not None:
                try:
                    poller.unregister(s)
                except KeyError:
                    pass
        if sub.sock is not None:
            try:
                sub.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            sub.sock.close(0)
        if sub.monitor is not None:
            sub.monitor.close(0)
        sub.sock = sub.monitor = None

    def _close(self, sub: _Sub, poller: zmq.Poller) -> None:
        self._close_live(sub, poller)
        if sub.dealer is not None:
            try:
                poller.unregister(sub.dealer)
            except KeyError:
                pass
            sub.dealer.close(0)
        sub.dealer = None

    def _on_monitor(self, sub: _Sub, poller: zmq.Poller, now: float) -> None:
        from zmq.utils.monitor import recv_monitor_message
        disconnected = False
        while sub.monitor.poll(0):
            disconnected |= recv_monitor_message(sub.monitor)["event"] == zmq.EVENT_DISCONNECTED
        if disconnected:
            self._read_live(sub, now)  # what arrived before the cut
            self._close_live(sub, poller)
            sub.reconnect_at = now + RECONNECT_AFTER

    def _read_live(self, sub: _Sub, now: float) -> None:
        t = self.tracker
        wall = time.time()
        for _ in range(MAX_PER_READ):
            try:
                frames = sub.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self._bad(sub, f"{len(frames)} frames", now)
                continue
            t.on_message(sub.address, decode_seq(frames[1]), frames[2], now, wall)

    def _bad(self, sub: _Sub, why: str, now: float) -> None:
        self.bad_frames += 1
        self.tracker.on_bad_message(sub.address, f"message of {why}", now)

    def _replays_due(self, poller: zmq.Poller, now: float) -> None:
        t = self.tracker
        for address, start in t.due_replays(now):
            sub = self.subs.get(address)
            if sub is None:
                continue
            if sub.dealer is not None:
                poller.unregister(sub.dealer)
                sub.dealer.close(0)
                sub.dealer = None
            if sub.replay_url is None:  # no replay socket: the replay fails at its timeout
                continue
            sub.dealer = self._socket(zmq.DEALER, sub.replay_url)
            sub.replay_start, sub.replayed = start, []
            poller.register(sub.dealer, zmq.POLLIN)
            sub.dealer.send_multipart(replay_request(start))
        for sub in self.subs.values():  # replays the tracker gave up on (timeout)
            ep = t.endpoints.get(sub.address)
            if sub.dealer is not None and (ep is None or ep.replay_started is None):
                poller.unregister(sub.dealer)
                sub.dealer.close(0)
                sub.dealer = None

    def _read_replay(self, sub: _Sub, poller: zmq.Poller, now: float) -> None:
        complete = None
        for _ in range(MAX_PER_READ * 4):
            try:
                frames = sub.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                item = split_replay(frames)
            except KVEventsError:
                complete = False
                break
            if item is None:
                complete = True
                break
            sub.replayed.append(item)
            if len(sub.replayed) > MAX_REPLAY_MESSAGES:
                complete = False
                break
        if complete is None:
            return
        poller.unregister(sub.dealer)
        sub.dealer.close(0)
        sub.dealer = None
        replayed, sub.replayed = sub.replayed, []
        self.tracker.on_replay(sub.address, sub.replay_start, replayed, complete, now)

    def _publish(self) -> None:
        deltas = self.tracker.take_deltas()
        now = time.monotonic()
        status = None
        if now >= self._next_status:  # counters: at most every KV_STATUS_INTERVAL
            status = self.tracker.status()
            self._next_status = now + defaults.KV_STATUS_INTERVAL
        if deltas or status is not None:
            with self._lock:
                self._deltas.extend(deltas)
                if status is not None:
                    self._status = status


class KVSources:
    """Finds where each endpoint publishes (asyncio, in the signals process's loop) and keeps
    the subscriber's endpoint set equal to the pool's."""

    def __init__(self, subscriber: KVSubscriber, events_port: int, replay_port: int,
                 retry: float = 2.0):
        self.subscriber = subscriber
        self.events_port = events_port
        self.replay_port = replay_port
        self.retry = retry
        self._tasks: dict[str, asyncio.Task] = {}
        self._session = None

    async def start(self) -> None:
        import aiohttp
        self._session = aiohttp.ClientSession()

    def sync(self, endpoints: list[str]) -> None:
        wanted = set(endpoints)
        for addr in list(self._tasks):
            if addr not in wanted:
                self._tasks.pop(addr).cancel()
                self.subscriber.unsubscribe(addr)
        for addr in wanted - self._tasks.keys():
            self._tasks[addr] = asyncio.create_task(self._find(addr), name=f"kv sources {addr}")

    def fixed(self, address: str) -> tuple[str, str | None]:
        host = _host(address)
        return (tcp(host, self.events_port),
                tcp(host, self.replay_port) if self.replay_port else None)

    async def _find(self, address: str) -> None:
        """GET /kv_event_sources until the endpoint answers: its sources, or the fixed ports
        where it has no such route (older vLLM)."""
        import aiohttp
        if self._session is None:  # endpoints may come before start() (no await between them)
            await self.start()
        while True:
            try:
                async with self._session.get(f"http://{address}/kv_event_sources",
                                             timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        try:
                            data = await resp.json(content_type=None)
                        except ValueError:
                            data = None
                        source = resolve_source(address, data)
                    elif 400 <= resp.status < 500:
                        source = None
                    else:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                await asyncio.sleep(self.retry)  # not up yet
        self.subscriber.subscribe(address, *(source or self.fixed(address)))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
