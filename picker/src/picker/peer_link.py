"""The replicas' direct link: each replica's signals process talks to every other one over TCP
(`--peer-port`, `--peers`), so that a standby routes as the leader would and knows at once when
the leader is gone.

What goes over it, one JSON object per line, each replica sending on the connections it opens and
reading on the ones it accepts:

    {"k": "hello", "id": IDENTITY, "pool": POOL}       first, both ways (the answer tells a
                                                       replica it reached itself)
    {"k": "hb", "a": acting, "l": leased, "left": bool}  the heartbeat, every HEARTBEAT seconds,
                                                       forwarded from worker 0 as it sends its
                                                       role (a hung worker 0 stops it)
    {"k": "changes", "loads": {...}, "adds": [...]}    in-flight counts of the endpoints that
                                                       changed, prefix-index additions (as the
                                                       Redis exchange, peer_store.py)
    {"k": "table", "loads": {...}}                     the whole table every PEER_SYNC_INTERVAL
    {"k": "outcomes", "o": [[Outcome fields], ...]}    what Envoy's access log told this replica
                                                       (the gateway sends it to the Ready one):
                                                       relayed so every replica learns alike

From what arrives, each peer's state (failover.PeerState): LIVE while heartbeats come, SILENT after
SILENCE seconds without one, LEFT once its heartbeat says it is leaving (SIGTERM: a handover; its
counts still apply while it drains), GONE when its connection closes without that (its process
died: the kernel closed its sockets, which the other side sees at once). When its last connection
closes (GONE, or LEFT and done), a peer's in-flight counts are dropped at once (what it was deciding
is retried here and counted again) but its since-scrape counts are held for `gone_hold` seconds
(two of this replica's scrape intervals): the requests it sent since its last scrape are running
on the engines and in none of this replica's scrapes yet, and a standby that took over without
them would pile its first decisions onto the endpoints the leader had just loaded. A silent
peer's counts are dropped after LOAD_TTL.

`--peers` names are resolved every RESOLVE_EVERY (a headless Service lists every replica, ready
or not); the replica's own address is found by its hello. Hand-written on asyncio streams: a
few line-delimited messages between the picker's own processes need no broker or RPC framework
(the Redis exchange, for active-active replicas, stays in peer_store.py). No TLS: the
NetworkPolicy admits only the picker's own pods to the peer port, and what crosses it is counts
and block hashes, no request content.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from picker.failover import GONE, LEFT, LIVE, SILENT, PeerState
from picker.signals.state import Load, merge_loads

log = logging.getLogger("picker.peer_link")
HEARTBEAT = 0.05       # seconds between heartbeats (worker 0's role messages)
SILENCE = 0.3          # seconds without a heartbeat after which a peer is SILENT
LOAD_TTL = 2.0         # seconds of silence after which a peer's counts are dropped
GONE_HOLD = 0.2        # seconds a gone peer's since-scrape counts are held (2 default scrapes)
RESOLVE_EVERY = 1.0    # seconds between resolutions of --peers
CONNECT_TIMEOUT = 1.0
RECONNECT_MIN, RECONNECT_MAX = 0.05, 1.0
MAX_LINE = 4 << 20     # bytes; a table of 1,024 endpoints is ~60 KB
MAX_QUEUED = 4096      # messages kept for a peer not connected now (the oldest go first)


def parse_peers(text: str) -> list[tuple[str, int]]:
    out = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return out


@dataclass
class _Peer:
    identity: str
    status: str = LIVE
    acting: bool = False
    leased: bool = False
    since: float = 0.0
    last_seen: float = 0.0
    connected: int = 0          # inbound connections open from it
    loads: dict[str, Load] = field(default_factory=dict)
    hold_until: float = 0.0     # gone: its since-scrape counts count until then

    def state(self) -> PeerState:
        return PeerState(self.identity, self.status, self.acting, self.leased, self.since)


class PeerLink:
    def __init__(self, identity: str, pool: str, listen: tuple[str, int],
                 peers: list[tuple[str, int]],
                 on_remote: Callable[[dict[str, Load], list], None] | None = None,
                 on_peers: Callable[[list[PeerState]], None] | None = None,
                 on_outcomes: Callable[[list[tuple]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, gone_hold: float = GONE_HOLD):
        self.identity, self.pool = identity, pool
        self.gone_hold = gone_hold   # the signals process sets it to two scrape intervals
        self.listen = listen
        self.names = peers
        self.on_remote = on_remote
        self.on_peers = on_peers
        self.on_outcomes = on_outcomes
        self.clock = clock
        self.peers: dict[str, _Peer] = {}
        self._out: dict[tuple[str, int], asyncio.Queue] = {}   # address -> its sender's queue
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._self_addresses: set[tuple[str, int]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._background: list[asyncio.Task] = []
        self._hb = {"k": "hb", "a": False, "l": False, "left": False}
        self.port: int | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        host = self.listen[0].strip("[]") or None
        self._server = await asyncio.start_server(self._accept, host, self.listen[1],
                                                  limit=MAX_LINE, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._background = [asyncio.create_task(self._resolve_loop()),
                            asyncio.create_task(self._silence_loop())]
        log.info("peer link", extra={"identity": self.identity, "port": self.port,
                                     "peers": [f"{h}:{p}" for h, p in self.names]})

    async def close(self) -> None:
        for t in [*self._background, *self._tasks.values()]:
            t.cancel()
        await asyncio.gather(*self._background, *self._tasks.values(), return_exceptions=True)
        if self._server is not None:
            self._server.close()

    # ---- what this replica tells the others -----------------------------------------------------
    def send_role(self, acting: bool, leased: bool, leaving: bool) -> None:
        """The heartbeat: sent at once to every peer (called as worker 0 reports its role)."""
        self._hb = {"k": "hb", "a": acting, "l": leased, "left": leaving}
        self._broadcast(self._hb)

    def publish_changes(self, changed: dict[str, Load], adds: list) -> None:
        self._broadcast({"k": "changes", "loads": changed, "adds": adds})

    def publish_table(self, table: dict[str, Load]) -> None:
        self._broadcast({"k": "table", "loads": table})

    def publish_outcomes(self, batch: list[tuple]) -> None:
        self._broadcast({"k": "outcomes", "o": batch})

    def _broadcast(self, msg: dict) -> None:
        if not self._out:
            return
        line = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        for q in self._out.values():
            if q.qsize() >= MAX_QUEUED:   # a peer that is gone or slow: its oldest go
                q.get_nowait()
            q.put_nowait(line)

    # ---- what the others tell this replica ------------------------------------------------------
    def remote_loads(self, addresses=None) -> dict[str, Load]:
        """The other replicas' summed counts (of `addresses`, or of every endpoint)."""
        now = self.clock()
        tables = [p.loads for p in self.peers.values() if p.loads and (
            p.hold_until > now or (p.connected or p.status == LIVE) and p.last_seen >= now - LOAD_TTL)]
        return merge_loads(tables, addresses)

    def states(self) -> list[PeerState]:
        return [p.state() for p in self.peers.values()]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = None
        try:
            hello = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
            msg = json.loads(hello) if hello else {}
            if msg.get("k") != "hello" or msg.get("pool") != self.pool:
                return
            writer.write((json.dumps({"k": "hello", "id": self.identity, "pool": self.pool})
                          + "\n").encode())
            if msg.get("id") == self.identity:
                return  # our own connector reached us: it stops on our answer
            peer = self._arrived(msg["id"])
            peer.connected += 1
            while True:
                line = await reader.readline()
                if not line:
                    break
                self._receive(peer, json.loads(line))
        except (asyncio.TimeoutError, ConnectionError, ValueError, KeyError, OSError):
            pass
        except asyncio.CancelledError:
            # the process is stopping; ending quietly keeps Python 3.11's stream callback from
            # logging the cancellation as an error (it calls task.exception() on it)
            return
        finally:
            writer.close()
            if peer is not None:
                peer.connected -= 1
                if not peer.connected:
                    self._lost(peer)

    def _arrived(self, identity: str) -> _Peer:
        now = self.clock()
        peer = self.peers.get(identity)
        if peer is None or peer.status == GONE:   # new, or a new process of a dead one
            peer = self.peers[identity] = _Peer(identity, status=LIVE, since=now, last_seen=now)
            log.info("peer joined", extra={"peer": identity})
            self._changed()
        peer.last_seen = now
        peer.hold_until = 0.0   # connected again: its own tables count
        return peer

    def _receive(self, peer: _Peer, msg: dict) -> None:
        now = self.clock()
        peer.last_seen = now
        kind = msg.get("k")
        if kind == "hb":
            status = LEFT if msg.get("left") else LIVE
            claim = (bool(msg.get("a")), bool(msg.get("l")))
            if status != peer.status or claim != (peer.acting, peer.leased):
                if status != peer.status:
                    peer.status, peer.since = status, now
                    log.info(f"peer {status}", extra={"peer": peer.identity})
                peer.acting, peer.leased = claim
                self._changed()
            return
        if peer.status == SILENT:   # any message proves it runs
            peer.status, peer.since = LIVE, now
            self._changed()
        if kind == "changes":
            loads = {a: tuple(v) for a, v in msg.get("loads", {}).items()}
            for a, v in loads.items():
                if any(v):
                    peer.loads[a] = v
                else:
                    peer.loads.pop(a, None)
            self._remote(set(loads), msg.get("adds", []))
        elif kind == "table":
            changed = set(peer.loads) | set(msg.get("loads", {}))
            peer.loads = {a: tuple(v) for a, v in msg.get("loads", {}).items()}
            self._remote(changed, [])
        elif kind == "outcomes" and self.on_outcomes is not None:
            self.on_outcomes([tuple(o) for o in msg.get("o", [])])

    def _lost(self, peer: _Peer) -> None:
        """Its last connection closed: it left (said so) or is gone (its process died)."""
        now = self.clock()
        changed = set(peer.loads)
        peer.loads = {a: (0, 0, load[2], load[3]) for a, load in peer.loads.items() if load[2] or load[3]}
        peer.hold_until = now + self.gone_hold if peer.loads else 0.0
        if peer.status != LEFT:
            peer.status, peer.since, peer.acting, peer.leased = GONE, now, False, False
            log.warning("peer gone", extra={"peer": peer.identity})
        self._changed()
        if changed:
            self._remote(changed, [])

    def _remote(self, addresses: set[str], adds: list) -> None:
        if self.on_remote is not None and (addresses or adds):
            self.on_remote(self.remote_loads(addresses), [tuple(a) for a in adds])

    def _changed(self) -> None:
        if self.on_peers is not None:
            self.on_peers(self.states())

    async def _silence_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT)
            now = self.clock()
            for peer in self.peers.values():
                if peer.status == LIVE and now - peer.last_seen > SILENCE:
                    peer.status, peer.since = SILENT, now
                    log.warning("peer silent", extra={"peer": peer.identity,
                                                      "seconds": round(now - peer.last_seen, 3)})
                    self._changed()
                if peer.hold_until and now >= peer.hold_until:
                    changed, peer.loads, peer.hold_until = set(peer.loads), {}, 0.0
                    self._remote(changed, [])
                elif peer.loads and now - peer.last_seen > LOAD_TTL and not peer.connected \
                        and not peer.hold_until:
                    changed, peer.loads = set(peer.loads), {}
                    self._remote(changed, [])

    # ---- connecting out -------------------------------------------------------------------------
    async def _resolve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            addresses: set[tuple[str, int]] = set()
            for host, port in self.names:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                    addresses |= {(i[4][0], i[4][1]) for i in infos}
                except OSError as exc:
                    log.warning("peer name not resolved", extra={"peer": f"{host}:{port}",
                                                                 "error": repr(exc)[:200]})
            addresses -= self._self_addresses
            for address, task in list(self._tasks.items()):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("peer connector failed", exc_info=task.exception(),
                              extra={"peer": f"{address[0]}:{address[1]}"})
                    self._tasks.pop(address)   # started again below
            for gone in set(self._tasks) - addresses:
                self._tasks.pop(gone).cancel()
                self._out.pop(gone, None)
            for address in addresses - set(self._tasks):
                self._out[address] = asyncio.Queue()
                self._tasks[address] = asyncio.create_task(self._connector(address))
            await asyncio.sleep(RESOLVE_EVERY)

    async def _connector(self, address: tuple[str, int]) -> None:
        """Keep a connection to `address` open and send it this replica's messages."""
        backoff = RECONNECT_MIN
        queue = self._out[address]
        while True:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(*address, limit=MAX_LINE), CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(backoff)
                backoff = min(RECONNECT_MAX, backoff * 2)
                continue
            try:
                writer.write((json.dumps({"k": "hello", "id": self.identity, "pool": self.pool})
                              + "\n").encode())
                answer = json.loads(await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
                                    or b"{}")
                if answer.get("id") == self.identity:
                    self._self_addresses.add(address)
                    self._out.pop(address, None)
                    self._tasks.pop(address, None)
                    return
                backoff = RECONNECT_MIN
                writer.write((json.dumps(self._hb) + "\n").encode())
                await self._send(queue, reader, writer)
            except (OSError, asyncio.TimeoutError, ValueError, RuntimeError):
                # RuntimeError: uvloop's answer to a write on a connection the peer closed
                pass
            finally:
                writer.close()
            await asyncio.sleep(backoff)

    @staticmethod
    async def _send(queue: asyncio.Queue, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        """Until the connection breaks: write what is queued; the peer's EOF ends it."""
        closed = asyncio.ensure_future(reader.read())
        try:
            while not closed.done():
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, closed}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done or closed in done or writer.transport.is_closing():
                    get.cancel()   # a message taken is dropped: the next heartbeat and table carry it
                    return
                writer.write(get.result())
                if writer.transport.get_write_buffer_size() > MAX_LINE:
                    await writer.drain()
        finally:
            closed.cancel()
