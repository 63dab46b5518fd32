"""The engine's own eviction, on two real vLLM engines (the CPU build serving the tiny model,
`make vllm`; skipped where it is not installed) with a deliberately small KV cache: it makes the
approximate prefix index wrong and precise routing (the engines' KV-cache events) right. Over 30 s:
the first test waits for two real vLLM servers to start (CPU build, ~30 s on 2 cores).

1. A tenant's first chat request goes to engine A through both pickers (the protocol's subset
   hint pins it there) and A serves it: both pickers hold its prefix on A.
2. Traffic sent to A directly, as another picker replica's requests would be, evicts the prefix
   in A's engine: its events show a BlockRemoved for every block of it. The approximate index
   knows only what its own picker sent and still holds the prefix on A.
3. B serves the tenant's first request directly: B holds the prefix, A no longer does.
4. The tenant's next request: the picker with precise routing names B, the approximate-only
   picker names A. B serves it from its prefix cache (vllm:prefix_cache_hits_total) and A does
   not, each exactly as the precise index said.

Both pickers are the whole service in this process (App: ext_proc over gRPC, the scraper and
the KV subscriber in its signals process) against the live engines, asked as Envoy asks."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from contextlib import asynccontextmanager

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import extproc_client as c
from helpers import free_ports, start_app, until
from loadtest.prompts import random_words
from local.vllm_server import VllmServer
from picker.app import App
from picker.openai import parse_body
from picker.scheduling.prefix import block_hashes
from picker.signals.kvevents import (BlockRemoved, BlockStored, EventBatch, decode_payload,
                                     replay_request, split_replay)
from picker.signals.kvstate import STAT_FIELDS, chain_hashes
from picker.tokenizer import ModelTokenizer
from vllm_engines import running, tiny_model_dir

pytestmark = pytest.mark.server  # starts other programs as processes

BLOCK = 128                 # the CPU backend's block size
NUM_BLOCKS = 16             # --num-gpu-blocks-override: 2,048 tokens of KV cache per engine
MAX_MODEL_LEN = 1024
SYSTEM_TOKENS = 700         # the tenant's system prompt: 5 full blocks shared by its requests
EVICTING = (850, 3)         # prompt tokens, requests: 3 x 7 blocks, more than the engine holds
CHAT = "/v1/chat/completions"
HITS = "vllm:prefix_cache_hits_total"
PROMPT = "vllm:prompt_tokens_total"
TIMEOUT = 60                # seconds for anything to show up on a busy 2-core machine


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory)
    ports = free_ports(6)
    servers = [VllmServer(port=ports[i], kv_events_port=ports[2 + i], kv_replay_port=ports[4 + i],
                          num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                          model_dir=model_dir) for i in range(2)]
    with running(servers, tmp_path_factory):
        yield model_dir, servers


def chat(system: str, user: str) -> dict:
    return {"model": "qwq", "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}


def _http(address: str, path: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{address}{path}", data,
                                 {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def engine_counters(address: str) -> dict[str, float]:
    """The engine's prefix-cache hits and prompt tokens (counters, in tokens)."""
    text = _http(address, "/metrics").decode()
    out = {HITS: 0.0, PROMPT: 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


async def serve(address: str, body: dict, path: str = CHAT) -> int:
    """The engine serves the request; returns the prompt tokens it took from its prefix cache."""
    before = await asyncio.to_thread(engine_counters, address)
    answer = json.loads(await asyncio.to_thread(_http, address, path, body))
    prompt_tokens = answer["usage"]["prompt_tokens"]
    after: dict[str, float] = {}

    async def counted() -> bool:  # the counters follow the answer by an engine step or so
        after.update(await asyncio.to_thread(engine_counters, address))
        return after[PROMPT] >= before[PROMPT] + prompt_tokens
    await until(counted, timeout=TIMEOUT, every=0.2)
    return int(after[HITS] - before[HITS])


def engine_history(server: VllmServer) -> list[EventBatch]:
    """Every batch of events the engine published since it started, from its replay socket."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{server.host}:{server.kv_replay_port}")
    try:
        sock.send_multipart(replay_request(0))
        batches = []
        while True:
            assert sock.poll(TIMEOUT * 1000), "the replay socket did not finish its answer"
            item = split_replay(sock.recv_multipart())
            if item is None:
                return batches
            batches.append(decode_payload(item[1]))
    finally:
        sock.close()


def engine_chain(events: list, ids: list[int]) -> list[int]:
    """The engine's own hashes of the leading full blocks of `ids` it stored (parent-chained)."""
    by_parent_and_tokens = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            for j, h in enumerate(ev.block_hashes):
                by_parent_and_tokens[(parent, tuple(ev.token_ids[j * BLOCK:(j + 1) * BLOCK]))] = h
                parent = h
    chain, parent = [], None
    for i in range(len(ids) // BLOCK):
        parent = by_parent_and_tokens.get((parent, tuple(ids[i * BLOCK:(i + 1) * BLOCK])))
        if parent is None:
            break
        chain.append(parent)
    return chain


@asynccontextmanager
async def routed(app: App, body: dict, subset: list[str] | None = None):
    """One ext_proc stream as Envoy opens it: yields the endpoint the picker names; the stream
    closes (the request ends for the picker) on the way out."""
    ch = c.channel(app.servers.grpc_port, None)
    try:
        _, answers = await c.send_full_duplex(c.ep_stub(ch), c.post_headers(CHAT),
                                              json.dumps(body).encode(), subset=subset)
        assert not answers[0].HasField("immediate_response"), answers[0]
        yield c.set_headers(answers[0].request_headers.response)["x-gateway-destination-endpoint"]
    finally:
        await ch.close()


def approximate_blocks(app: App, body: dict, address: str) -> tuple[int, int]:
    """(leading blocks of the request the approximate index holds on `address`, blocks)."""
    profile = app.router.profile
    hashes = block_hashes("qwq", parse_body(json.dumps(body).encode()).prompt,
                          profile.block_size_tokens, profile.max_prefix_blocks)
    return app.router.prefix.match(hashes).get(address, 0), len(hashes)


def kv_counters(app: App, address: str) -> dict[str, float]:
    """The picker's KV-event counters for one endpoint (empty until the first status)."""
    status = app.router.precise.status.get(address)
    return dict(zip(STAT_FIELDS, status[3])) if status else {}


def common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def scraped_idle(apps: list[App], epochs: dict) -> bool:
    """Every picker has scraped every engine twice since `epochs` and saw it idle."""
    return all(e.epoch >= epochs[id(app), a] + 2 and e.metrics is not None
               and e.metrics.running == 0 and e.metrics.waiting == 0
               for app in apps for a, e in app.router.endpoints.items())


def epochs_now(apps: list[App]) -> dict:
    return {(id(app), a): e.epoch for app in apps for a, e in app.router.endpoints.items()}


@asynccontextmanager
async def pickers(model_dir, addresses: list[str]):
    """(precise, approximate-only): the default profile, one with the model's tokenizer, one
    with --no-precise-prefix. Generous staleness: slow scrapes on a busy machine must not
    turn an engine saturated, which is not what this test is about."""
    common = ["--staleness", "30"]
    started = []
    try:
        for extra in (["--tokenizer", str(model_dir)], ["--no-precise-prefix"]):
            app, _, maintain = await start_app(common + extra, addresses, scrape_interval=0.2)
            started.append((app, maintain))
        yield started[0][0], started[1][0]
    finally:
        for app, maintain in started:
            app.request_stop()
            await maintain
            await app.stop()


@pytest.mark.timeout(900)
async def test_engine_eviction_misleads_the_approximate_index_not_precise_routing(engines):
    model_dir, servers = engines
    a, b = (s.address for s in servers)
    tok = ModelTokenizer(model_dir)
    rng = np.random.default_rng(11)
    system = random_words(rng, SYSTEM_TOKENS)
    first = chat(system, random_words(rng, 20))
    first_ids = tok.request_tokens(CHAT, first)
    tenant_chain = chain_hashes(first_ids, BLOCK)
    async with pickers(model_dir, [a, b]) as (precise_app, approx_app):
        index = precise_app.router.precise.index
        await until(lambda: all(e.ready for app in (precise_app, approx_app)
                                for e in app.router.endpoints.values()), timeout=TIMEOUT)
        await until(lambda: index.in_sync(a) and index.in_sync(b), timeout=TIMEOUT)

        # 1. the tenant's first request: routed to A by both pickers, served by A
        async with routed(precise_app, first, subset=[a]) as to_precise, \
                routed(approx_app, first, subset=[a]) as to_approx:
            assert to_precise == to_approx == a
            assert await serve(a, first) == 0
        await until(lambda: all(index.holds(h, a) for h in tenant_chain), timeout=TIMEOUT)
        assert index.block_size[a] == BLOCK    # learnt from the events (nothing before them)
        held, blocks = approximate_blocks(approx_app, first, a)
        assert held == blocks > 0

        # 2. other traffic on A, not through these pickers, evicts the prefix in A's engine
        size, count = EVICTING
        for _ in range(count):
            assert await serve(a, {"model": "qwq", "max_tokens": 1,
                                   "prompt": random_words(rng, size)}, "/v1/completions") == 0
        await until(lambda: not any(index.holds(h, a) for h in tenant_chain), timeout=TIMEOUT)
        history = await asyncio.to_thread(engine_history, servers[0])
        events = [ev for batch in history for ev in batch.events]
        stored_on_a = engine_chain(events, first_ids)
        removed = {h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
        assert len(stored_on_a) == len(tenant_chain) >= 5
        assert set(stored_on_a) <= removed, "A's engine did not report evicting the prefix"
        await until(lambda: kv_counters(precise_app, a).get("batches", 0) >= len(history),
                    timeout=TIMEOUT)           # the counters come every KV_STATUS_INTERVAL
        assert kv_counters(precise_app, a)["overflow"] == 0, \
            "the picker's capacity cap dropped blocks: the engine's events alone must evict"
        assert approximate_blocks(approx_app, first, a) == (blocks, blocks), \
            "the approximate index was expected to keep the prefix on A"

        # 3. B serves the tenant's first request (directly): B holds the prefix, A does not
        assert await serve(b, first) == 0
        await until(lambda: all(index.holds(h, b) for h in tenant_chain), timeout=TIMEOUT)

        # 4. the tenant's next request: precise routing names B, the approximate index A
        nxt = chat(system, random_words(rng, 20))
        next_chain = chain_hashes(tok.request_tokens(CHAT, nxt), BLOCK)
        shared = common_prefix(tenant_chain, next_chain)
        engine_view = index.match(next_chain)          # before the decisions add in-flight entries
        assert engine_view.get(b) == shared >= 5 and a not in engine_view
        epochs = epochs_now([precise_app, approx_app])
        await until(lambda: scraped_idle([precise_app, approx_app], epochs), timeout=TIMEOUT)
        async with routed(precise_app, nxt) as to_precise, \
                routed(approx_app, nxt) as to_approx:
            assert to_approx == a, "the approximate-only picker follows its stale index to A"
            assert to_precise == b, "precise routing follows the engines' events to B"
            hits_b = await serve(to_precise, nxt)
            hits_a = await serve(to_approx, nxt)
        assert hits_b == shared * BLOCK, "B did not serve the prefix from its cache"
        assert hits_a == 0, "A still held part of the prefix its events said it evicted"
