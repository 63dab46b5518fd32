"""Replicas with one view: in-flight counts and prefix-index additions shared through Redis.

Run by the signals process of each replica (--peer-store redis://HOST:PORT/DB), over one Redis
pub/sub channel per pool, `picker:<pool>:peers`. Each message is JSON
`[replica, kind, {address: [inflight, tokens, since_scrape, since_tokens]}, prefix additions]`:

- "changes": as this replica's workers decide and finish requests, the new counts (summed over
  its workers) of the endpoints that changed, and the prefix-index additions of the decisions;
- "table": every PEER_SYNC_INTERVAL, all of this replica's non-zero counts (a heartbeat, and the
  correction for anything a subscriber missed).

A replica not heard from for LOAD_TTL seconds counts for nothing (it stopped or lost Redis). A
replica that loses Redis keeps routing on its own view and retries; one that starts late learns
prefixes from the decisions made after it started (the index refills as traffic flows).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Callable

from picker.signals.state import Load, merge_loads

log = logging.getLogger("picker.peers")
LOAD_TTL = 2.0   # seconds without a message after which a replica's counts are dropped


class RedisPeers:
    def __init__(self, url: str, pool: str, replica: str | None = None,
                 on_remote: Callable[[dict[str, Load], list], None] | None = None):
        self.url = url
        self.channel = f"picker:{pool}:peers"
        self.replica = replica or f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.on_remote = on_remote  # (changed addresses' remote sums, prefix additions)
        self._tables: dict[str, dict[str, Load]] = {}
        self._seen: dict[str, float] = {}
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._redis = None
        self._tasks: list[asyncio.Task] = []
        self._failing = False

    async def start(self) -> None:
        import redis.asyncio as redis
        self._redis = redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._send())]

    # ---- what this replica tells the others ----------------------------------------------------
    def publish_changes(self, changed: dict[str, Load], adds: list) -> None:
        self._outbox.put_nowait(json.dumps([self.replica, "changes", changed, adds]))

    def publish_table(self, table: dict[str, Load]) -> None:
        self._outbox.put_nowait(json.dumps([self.replica, "table", table, []]))

    async def _send(self) -> None:
        while True:
            msg = await self._outbox.get()
            try:
                await self._redis.publish(self.channel, msg)
                self._ok()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn(exc)
                while not self._outbox.empty():  # the heartbeat table makes up for the loss
                    self._outbox.get_nowait()
                await asyncio.sleep(0.5)

    # ---- what the others tell this replica ------------------------------------------------------
    async def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        self._receive(json.loads(msg["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone or restarting: keep our own view, retry
                self._warn(exc)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def _receive(self, msg: list) -> None:
        sender, kind, loads, adds = msg
        if sender == self.replica:
            return
        self._seen[sender] = time.monotonic()
        table = self._tables.setdefault(sender, {})
        if kind == "table":
            changed = set(table) | set(loads)
            table.clear()
            table.update((a, tuple(v)) for a, v in loads.items())
        else:
            changed = set(loads)
            for a, v in loads.items():
                if any(v):
                    table[a] = tuple(v)
                else:
                    table.pop(a, None)
        if self.on_remote is not None:
            self.on_remote(self.remote_loads(changed), [tuple(a) for a in adds])

    def remote_loads(self, addresses=None) -> dict[str, Load]:
        """The other live replicas' summed counts (of `addresses`, or of every endpoint)."""
        cutoff = time.monotonic() - LOAD_TTL
        for r in [r for r, t in self._seen.items() if t < cutoff]:
            del self._seen[r], self._tables[r]
        return merge_loads(self._tables.values(), addresses)

    def _ok(self) -> None:
        if self._failing:
            log.info("peer store reachable again", extra={"url": self.url})
            self._failing = False

    def _warn(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("peer store unreachable: routing on this replica's own view",
                        extra={"url": self.url, "error": repr(exc)[:200]})
            self._failing = True

    async def close(self) -> None:
        """Tell the others this replica has nothing in flight any more, then disconnect."""
        if self._redis is not None and not self._failing:
            try:
                await asyncio.wait_for(self._redis.publish(
                    self.channel, json.dumps([self.replica, "table", {}, []])), 1.0)
            except Exception:
                pass
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
