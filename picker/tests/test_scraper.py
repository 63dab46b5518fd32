"""The scraper against fake vLLM /metrics servers started in-test on 127.0.0.1."""

from picker.scraper import Scraper

from picker.core import RequestInfo

from helpers import FakeVllm, body, make_router, metrics_text, until


async def test_scrapes_on_interval_and_follows_endpoint_changes():
    a, b = await FakeVllm().start(), await FakeVllm().start()
    router = make_router(scrape=False)
    router.set_endpoints([a.address])
    scraper = Scraper(router, interval=0.02)
    await scraper.start()
    try:
        await until(lambda: a.hits >= 3)
        state = router.endpoints[a.address]
        assert state.ready and state.metrics.waiting == 2 and state.metrics.kv_usage == 0.3
        router.set_endpoints([b.address])
        scraper.sync()
        await until(lambda: router.endpoints[b.address].ready)
        hits = a.hits
        await until(lambda: b.hits >= hits + 3)
        assert a.hits <= hits + 1  # a's task was stopped
    finally:
        await scraper.close()
        await a.stop()
        await b.stop()


async def test_failing_endpoint_is_out_until_it_answers_again():
    a = await FakeVllm().start()
    router = make_router(scrape=False)
    router.set_endpoints([a.address, "127.0.0.1:9"])  # port 9: nothing listens
    scraper = Scraper(router, interval=0.02)
    await scraper.start()
    try:
        await until(lambda: router.endpoints[a.address].ready)
        assert not router.endpoints["127.0.0.1:9"].ready
        assert router.endpoints["127.0.0.1:9"].scrape_errors >= 1
        a.status = 500
        await until(lambda: not router.endpoints[a.address].ready)
        a.status, a.text = 200, "not metrics at all\n"
        hits = a.hits
        await until(lambda: a.hits > hits + 1)
        assert not router.endpoints[a.address].ready  # unparsable page counts as a failure
        a.text = metrics_text(waiting=7)
        await until(lambda: router.endpoints[a.address].ready)
        assert router.endpoints[a.address].metrics.waiting == 7
    finally:
        await scraper.close()
        await a.stop()


async def test_idle_adapters_from_v1_models_become_routable():
    """vLLM lists an adapter loaded with --lora-modules in /v1/models even when no request uses
    it (its /metrics then names it nowhere); the scraper reads the list on a slower interval."""
    a = await FakeVllm().start()
    a.text = metrics_text(lora={"max": 2, "running": []})
    router = make_router(scrape=False)
    router.set_endpoints([a.address])
    scraper = Scraper(router, interval=0.02, models_interval=0.2)
    await scraper.start()
    try:
        await until(lambda: a.model_hits >= 2)  # 404: retried at the following scrapes
        assert not router.endpoints[a.address].serves("sql-lora")
        a.models = {"object": "list", "data": [
            {"id": "qwq", "object": "model", "root": "/mnt/models", "parent": None},
            {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "qwq"}]}
        await until(lambda: router.endpoints[a.address].serves("sql-lora"))
        assert router.decide(RequestInfo("/v1/completions", {}, body(model="sql-lora"))).endpoint == a.address
        hits, scrapes = a.model_hits, a.hits
        await until(lambda: a.hits >= scrapes + 20)
        assert a.model_hits - hits <= 3  # every models_interval, not every scrape
        a.models = {"object": "list", "data": [{"id": "qwq"}]}  # adapter unloaded
        await until(lambda: not router.endpoints[a.address].serves("sql-lora"))
    finally:
        await scraper.close()
        await a.stop()
