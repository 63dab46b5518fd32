"""Scrape every endpoint's /metrics on an interval (one task per endpoint) into a sink.

A driver, like app.py: the sink is the Router (in process, as in the tests and the lab) or the
signals process's collector, which parses pages away from the decision path (signals_process.py).
The sink has `endpoints` (the addresses to scrape), `on_scrape_ok(address, text)` (raises
MetricsParseError on a bad page) and `on_scrape_failed(address, timed_out=False)`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from picker import defaults
from picker.signals.metrics import MetricsParseError
from picker.signals.models import ModelsParseError, parse_models

log = logging.getLogger("picker.scraper")


class Scraper:
    def __init__(self, sink: Any, interval: float = defaults.SCRAPE_INTERVAL,
                 timeout: float | None = None, models_interval: float = defaults.MODELS_INTERVAL):
        self.sink = sink
        self.interval = interval
        self.models_interval = models_interval
        self.fixed_timeout = timeout
        self.timeout = timeout if timeout is not None else defaults.scrape_timeout_for(interval)
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self._failures: dict[str, int] = {}  # consecutive failures per endpoint, for the log
        self.scrapes = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            auto_decompress=True)
        self.sync()

    def sync(self) -> None:
        """Start tasks for new endpoints and stop those of removed ones."""
        if self._session is None:
            return
        wanted = set(self.sink.endpoints)
        for addr in list(self._tasks):
            if addr not in wanted:
                self._tasks.pop(addr).cancel()
                self._failures.pop(addr, None)
        for addr in wanted - self._tasks.keys():
            self._tasks[addr] = asyncio.create_task(self._loop(addr), name=f"scrape {addr}")

    def set_interval(self, interval: float) -> None:
        """Takes effect from each endpoint's next scrape (the timeout follows, unless fixed)."""
        self.interval = interval
        if self.fixed_timeout is None:
            self.timeout = defaults.scrape_timeout_for(interval)

    async def scrape_once(self, addr: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{addr}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text(errors="replace")
            self.sink.on_scrape_ok(addr, text)
            self.scrapes += 1
            self._failures[addr] = 0
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, MetricsParseError) as exc:
            if not isinstance(exc, MetricsParseError):  # a parse error already counted as failed
                self.sink.on_scrape_failed(addr, timed_out=isinstance(exc, asyncio.TimeoutError))
            failures = self._failures[addr] = self._failures.get(addr, 0) + 1
            if failures == 1:  # log the first of a run of failures, not every one
                log.warning("scrape failed", extra={"endpoint": addr, "error": repr(exc)[:200]})
            return False

    async def list_models(self, addr: str) -> bool:
        """Read the endpoint's /v1/models (its LoRA adapters, idle ones too) into the sink."""
        assert self._session is not None
        try:
            async with self._session.get(f"http://{addr}/v1/models") as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                names = parse_models(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ModelsParseError) as exc:
            log.debug("listing models failed", extra={"endpoint": addr, "error": repr(exc)[:200]})
            return False
        on_models = getattr(self.sink, "on_models", None)
        if on_models is not None:
            on_models(addr, names)
        return True

    async def _loop(self, addr: str) -> None:
        loop = asyncio.get_running_loop()
        models_due = loop.time()
        while True:
            started = loop.time()
            ok = await self.scrape_once(addr)
            if ok and started >= models_due:
                # retried at the next scrape until it succeeds, then every models_interval
                if await self.list_models(addr):
                    models_due = started + self.models_interval
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
