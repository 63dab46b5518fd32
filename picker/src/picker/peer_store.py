"""Replicas with one view: in-flight counts and prefix-index additions shared through Redis.

Run by the signals process of each replica (--peer-store redis://HOST:PORT/DB). Every
PEER_SYNC_INTERVAL it
- writes the replica's in-flight counts (the sum over its workers) under
  `picker:<pool>:load:<replica>`, expiring after LOAD_TTL so a dead replica's counts vanish,
  and its name in the sorted set `picker:<pool>:replicas` scored by the time it was written;
- reads the counts of every other replica written within LOAD_TTL;
- publishes the prefix-index additions of its decisions on the channel `picker:<pool>:prefix`
  and applies those the other replicas published.
A replica that loses Redis keeps routing on its own view and retries; one that starts late
learns prefixes from the decisions made after it started (the index refills as traffic flows).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid

from picker.signals.state import Load

log = logging.getLogger("picker.peers")
LOAD_TTL = 2.0   # seconds a replica's counts stay without being rewritten


class RedisPeers:
    def __init__(self, url: str, pool: str, replica: str | None = None):
        self.url = url
        self.prefix = f"picker:{pool}"
        self.replica = replica or f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.remote_loads: dict[str, Load] = {}
        self.remote_adds: list = []
        self._redis = None
        self._pubsub = None
        self._listener: asyncio.Task | None = None
        self._failing = False

    async def start(self) -> None:
        import redis.asyncio as redis
        self._redis = redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        channel = f"{self.prefix}:prefix"
        while True:
            try:
                self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(channel)
                async for msg in self._pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    sender, adds = json.loads(msg["data"])
                    if sender != self.replica:
                        self.remote_adds.extend((a, h, c) for a, h, c in adds)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone or restarting: keep our own view, retry
                self._warn(exc)
                await asyncio.sleep(1.0)

    async def exchange(self, own: dict[str, Load], adds: list) -> None:
        """Publish ours, read theirs (self.remote_loads, self.remote_adds)."""
        r = self._redis
        now = time.time()
        try:
            async with r.pipeline(transaction=False) as p:
                p.set(f"{self.prefix}:load:{self.replica}", json.dumps(own), px=int(LOAD_TTL * 1000))
                p.zadd(f"{self.prefix}:replicas", {self.replica: now})
                p.zremrangebyscore(f"{self.prefix}:replicas", 0, now - 10 * LOAD_TTL)
                p.zrangebyscore(f"{self.prefix}:replicas", now - LOAD_TTL, "+inf")
                if adds:
                    p.publish(f"{self.prefix}:prefix", json.dumps([self.replica, adds]))
                results = await p.execute()
            others = [m.decode() for m in results[3] if m.decode() != self.replica]
            loads: dict[str, list[int]] = {}
            if others:
                for raw in await r.mget([f"{self.prefix}:load:{o}" for o in others]):
                    if raw is None:
                        continue
                    for addr, load in json.loads(raw).items():
                        t = loads.setdefault(addr, [0, 0, 0, 0])
                        for k in range(4):
                            t[k] += load[k]
            self.remote_loads = {a: tuple(t) for a, t in loads.items()}
            if self._failing:
                log.info("peer store reachable again", extra={"url": self.url})
                self._failing = False
        except Exception as exc:
            self._warn(exc)
            self.remote_loads = {}

    def take_adds(self) -> list:
        adds, self.remote_adds = self.remote_adds, []
        return adds

    def _warn(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("peer store unreachable: routing on this replica's own view",
                        extra={"url": self.url, "error": repr(exc)[:200]})
            self._failing = True

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        if self._pubsub is not None:
            try:
                await self._pubsub.aclose()
            except Exception:
                pass
        if self._redis is not None:
            try:
                await self._redis.delete(f"{self.prefix}:load:{self.replica}")
            except Exception:
                pass
            await self._redis.aclose()
