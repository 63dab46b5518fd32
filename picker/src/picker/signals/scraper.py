"""Scrape every endpoint's /metrics on an interval (one task per endpoint) into the Router.

Default interval 100 ms: a vLLM engine step (one decode token for the whole batch) takes tens of
milliseconds to ~100 ms on the target hardware, so 100 ms sees each change within about one
step; the in-flight counts cover requests sent between scrapes. The upstream picker scrapes
every 50 ms from Go; from Python that doubles the CPU for little gain (see README, bench).
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from picker.core import Router
from picker.signals.metrics import MetricsParseError
from picker.signals.models import ModelsParseError, parse_models

log = logging.getLogger("picker.scraper")
DEFAULT_INTERVAL = 0.1
# /v1/models (loaded LoRA adapters) changes only when adapters are loaded or unloaded.
MODELS_INTERVAL = 10.0


class Scraper:
    def __init__(self, router: Router, interval: float = DEFAULT_INTERVAL,
                 timeout: float | None = None, models_interval: float = MODELS_INTERVAL):
        self.router = router
        self.interval = interval
        self.models_interval = models_interval
        self.timeout = timeout if timeout is not None else max(0.5, 5 * interval)
        self._tasks: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.scrapes = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            auto_decompress=True)
        self.sync()

    def sync(self) -> None:
        """Start tasks for new endpoints and stop those of removed ones."""
        if self._session is None:
            return
        wanted = set(self.router.endpoints)
        for addr in list(self._tasks):
            if addr not in wanted:
                self._tasks.pop(addr).cancel()
        for addr in wanted - self._tasks.keys():
            self._tasks[addr] = asyncio.create_task(self._loop(addr), name=f"scrape {addr}")

    async def scrape_once(self, addr: str) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"http://{addr}/metrics") as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text(errors="replace")
            self.router.on_scrape_ok(addr, text)
            self.scrapes += 1
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, MetricsParseError) as exc:
            state = self.router.endpoints.get(addr)
            was_ok = state is not None and not state.failing and state.metrics is not None
            if not isinstance(exc, MetricsParseError):  # a parse error already counted as failed
                self.router.on_scrape_failed(addr)
            if was_ok or state is None or state.scrape_errors == 1:
                log.warning("scrape failed", extra={"endpoint": addr, "error": repr(exc)[:200]})
            return False

    async def list_models(self, addr: str) -> bool:
        """Read the endpoint's /v1/models into the Router (its idle LoRA adapters)."""
        assert self._session is not None
        try:
            async with self._session.get(f"http://{addr}/v1/models") as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                names = parse_models(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ModelsParseError) as exc:
            log.debug("listing models failed", extra={"endpoint": addr, "error": repr(exc)[:200]})
            return False
        self.router.on_models(addr, names)
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
