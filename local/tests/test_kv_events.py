"""KV-cache events: the engine's allocator records them in order; the server publishes them in
vLLM's wire format (ZMQ PUB + replay ROUTER), decoded here by a subscriber written from vLLM's
published schema, not with the simulator's classes. The same subscriber first decodes the frames
captured from a real vLLM 0.32 server, so the schema below is checked against real bytes."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import socket
import zlib
from pathlib import Path
from typing import Optional, Union

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from local.sim.engine import AllBlocksCleared, BlockRemoved, BlockStored, Engine, block_hashes
from local.sim.engines import TINY
from local.sim.kv_events import KVEventsConfig
from local.sim.server import SimServer

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "vllm-samples" / \
    "kv-events-vllm-0.32.0.jsonl"


# ----- the subscriber's schema, from vLLM's vllm/distributed/kv_events.py (0.32: events are
# maps tagged by "type"; unknown keys are ignored by msgspec) --------------------------------

class VllmBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: Optional[str] = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class VllmBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODER = msgspec.msgpack.Decoder(VllmBatch)


def test_subscriber_schema_decodes_real_vllm_frames():
    if not SAMPLES.is_file():
        pytest.skip("vLLM samples not present")
    kinds = set()
    for line in SAMPLES.read_text().splitlines():
        rec = json.loads(line)
        if not rec.get("payload_b64"):
            continue
        batch = DECODER.decode(base64.b64decode(rec["payload_b64"]))
        kinds.update(type(e).__name__ for e in batch.events)
        for e in batch.events:
            if isinstance(e, VllmBlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
    assert kinds == {"VllmBlockStored", "VllmBlockRemoved", "VllmAllBlocksCleared"}


# ----- the engine core's events ---------------------------------------------------------------

ENGINE = TINY.with_overrides(max_num_batched_tokens=64)       # 16 blocks of 4 tokens


def run(engine, clock, limit=10_000):
    for _ in range(limit):
        result = engine.step()
        if result is None:
            return
        clock[0] += result.duration_s
    raise AssertionError("engine did not drain")


def make_engine(**overrides):
    clock = [0.0]
    model = ENGINE.with_overrides(**overrides) if overrides else ENGINE
    return Engine(model, lambda: clock[0], kv_events=True), clock


def test_stored_blocks_carry_chain_and_tokens_and_skip_the_partial_block():
    engine, clock = make_engine()
    prompt = list(range(10))                     # 2 full blocks + 2 tokens
    engine.add_request("a", prompt, max_tokens=1)
    run(engine, clock)
    events = engine.take_kv_events()
    assert events == [BlockStored(block_hashes(prompt, 4), None, prompt[:8], 4)]
    assert all(0 <= h < 2**64 for h in events[0].block_hashes)
    assert engine.take_kv_events() == []


def test_full_prefix_hit_publishes_nothing_and_an_extension_only_new_blocks():
    engine, clock = make_engine()
    prompt = list(range(9))
    engine.add_request("a", prompt, max_tokens=1)
    run(engine, clock)
    first = engine.take_kv_events()[0]
    engine.add_request("b", prompt, max_tokens=1)
    run(engine, clock)
    assert engine.take_kv_events() == []
    longer = prompt[:8] + list(range(100, 110))
    engine.add_request("c", longer, max_tokens=1)
    run(engine, clock)
    (ext,) = engine.take_kv_events()
    assert ext.parent_block_hash == first.block_hashes[-1]
    assert ext.block_hashes == block_hashes(longer, 4)[2:]
    assert ext.token_ids == longer[8:16]


def test_blocks_filled_by_generated_tokens_are_stored_with_the_output_ids():
    engine, clock = make_engine()
    prompt = list(range(6))
    engine.add_request("a", prompt, max_tokens=9)   # KV computed for 6 + 8 tokens: 3 blocks
    run(engine, clock)
    events = engine.take_kv_events()
    stored = [h for e in events for h in e.block_hashes]
    assert len(stored) == 3 and len(set(stored)) == 3
    prompt_block, decode = events[0], events[1:]
    assert prompt_block.block_hashes == block_hashes(prompt, 4)
    assert [e.parent_block_hash for e in decode] == stored[:-1]
    outputs = [engine.output_token(zlib.crc32(b"a"), i) for i in range(6)]
    assert decode[0].token_ids == prompt[4:6] + outputs[:2]
    assert decode[1].token_ids == outputs[2:6]


def test_evictions_are_one_event_per_block_tail_first_and_clear_is_recorded():
    engine, clock = make_engine()
    a = list(range(32))                          # 8 blocks cached after a finishes
    engine.add_request("a", a, max_tokens=1)
    run(engine, clock)
    stored_a = engine.take_kv_events()[0].block_hashes
    engine.add_request("b", list(range(1000, 1044)), max_tokens=1)   # 11 blocks: evicts 3
    run(engine, clock)
    events = engine.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[h] for h in reversed(stored_a[-3:])]
    assert events.index(removed[-1]) < events.index(
        next(e for e in events if isinstance(e, BlockStored)))    # removals first
    assert engine.reset_prefix_cache()
    assert engine.take_kv_events() == [AllBlocksCleared()]
    assert not engine.refs


def test_reset_is_refused_while_requests_hold_blocks():
    engine, clock = make_engine()
    engine.add_request("a", list(range(8)), max_tokens=4)
    engine.step()
    assert not engine.reset_prefix_cache()
    assert not any(isinstance(e, AllBlocksCleared) for e in engine.take_kv_events())


def test_replaying_the_events_gives_the_engines_cached_set_at_every_step():
    """The invariant a subscriber relies on, under eviction and preemption pressure."""
    engine, clock = make_engine(num_gpu_blocks=24, max_num_seqs=4)
    rng = random.Random(7)
    prefixes = [list(range(p * 1000, p * 1000 + 12)) for p in range(4)]
    view: set = set()
    for i in range(200):
        if rng.random() < 0.6:
            prompt = prefixes[rng.randrange(4)] + [rng.randrange(10**6) for _ in range(rng.randrange(1, 9))]
            engine.add_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 30))
        result = engine.step()
        if result is not None:
            clock[0] += result.duration_s
        for e in engine.take_kv_events():
            if isinstance(e, BlockStored):
                assert not view & set(e.block_hashes)
                view.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= view
                view.difference_update(e.block_hashes)
            else:
                view.clear()
        assert view == set(engine.refs)
    assert engine.num_preemptions > 0 and len(view) > 0


def test_without_recording_nothing_is_kept():
    clock = [0.0]
    engine = Engine(ENGINE, lambda: clock[0])
    engine.add_request("a", list(range(12)), max_tokens=6)
    run(engine, clock)
    assert engine.kv_events is None and engine.take_kv_events() == []


# ----- config ---------------------------------------------------------------------------------

def test_config_parses_vllms_json_and_refuses_bad_fields():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",'
                                 ' "replay_endpoint": "tcp://*:5558", "topic": "kv"}')
    assert c.publisher == "zmq" and c.publishes and c.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').publishes
    for bad, word in (('[1]', "object"), ('{"endpont": "x"}', "endpont"),
                      ('{"buffer_steps": 0}', "buffer_steps"), ('{"publisher": "kafka"}', "kafka"),
                      ('{"endpoint": "localhost:5557"}', "endpoint"), ('{', "JSON")):
        with pytest.raises(ValueError, match=word):
            KVEventsConfig.from_json(bad)


# ----- over ZMQ, from the HTTP server -----------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_ENGINE = TINY.with_overrides(num_gpu_blocks=64, max_model_len=512,
                                    max_num_batched_tokens=64, max_num_seqs=8)


async def start_sim(stack, tokenizer=None):
    pub, replay = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv@sim-0")
    server = SimServer(SERVER_ENGINE, ["qwq"], speedup=1000.0, kv_events=config,
                       tokenizer=tokenizer)
    client = TestClient(TestServer(server.make_app(), host="127.0.0.1"))
    await client.start_server()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    stack.append((client, sub, ctx))
    return client, server, sub, ctx, config, replay


@pytest.fixture
async def sims():
    stack = []
    yield stack
    for client, sub, ctx in stack:
        sub.close(linger=0)
        await client.close()
        ctx.term()


@pytest.fixture
async def sim_with_events(sims):
    return await start_sim(sims)


@pytest.fixture(scope="module")
def model_tokenizer(tmp_path_factory):
    from local.sim.tokenizer import ModelTokenizer
    from local.tinymodel.tokenizer import write_tokenizer
    return ModelTokenizer(write_tokenizer(tmp_path_factory.mktemp("tiny-model")))


async def recv(sock, timeout=5.0):
    return await asyncio.wait_for(sock.recv_multipart(), timeout)


async def complete(client, prompt, max_tokens=1):
    body = {"model": "qwq", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    await resp.read()


async def wait_subscribed(client, sub):
    """PUB drops messages until the subscription has arrived (ZMQ's slow joiner): send
    one-block prompts until a batch arrives."""
    for i in range(50):
        await complete(client, f"warm{i} a b c d")
        try:
            return await recv(sub, timeout=0.1)
        except asyncio.TimeoutError:
            continue
    raise AssertionError("no KV event reached the subscriber")


async def test_server_publishes_vllm_frames_in_order_and_replays_them(sim_with_events):
    client, server, sub, ctx, config, replay_port = sim_with_events
    first = await wait_subscribed(client, sub)
    topic, seq, payload = first
    assert topic == b"kv@sim-0" and len(seq) == 8
    live = {int.from_bytes(seq, "big"): payload}
    prompt = " ".join(f"w{i}" for i in range(30))        # 7 full blocks of 4 words + 2
    await complete(client, prompt, max_tokens=6)
    await complete(client, prompt)                         # a full prefix hit: nothing
    while True:
        try:
            topic, seq, payload = await recv(sub, timeout=0.5)
        except asyncio.TimeoutError:
            break
        live[int.from_bytes(seq, "big")] = payload
    seqs = sorted(live)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))      # consecutive, one per batch
    batches = [DECODER.decode(live[s]) for s in seqs]
    stored = [e for b in batches for e in b.events if isinstance(e, VllmBlockStored)]
    prompt_blocks = [e for e in stored if len(e.block_hashes) == 7]
    assert len(prompt_blocks) == 1 and prompt_blocks[0].parent_block_hash is None
    assert len(prompt_blocks[0].token_ids) == 7 * 4 and prompt_blocks[0].medium == "GPU"
    decode = [e for e in stored if e.parent_block_hash == prompt_blocks[0].block_hashes[-1]]
    assert len(decode) == 1          # 30 + 5 computed tokens: the 8th block filled by decoding
    assert all(b.data_parallel_rank == 0 and b.ts > 1e9 for b in batches)

    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        await dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = {}
        while True:
            frames = await recv(dealer)
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == b"\xff" * 8:
                assert frames[1] == b"" and frames[3] == b""
                break
            assert frames[1] == b"kv@sim-0"
            replayed[int.from_bytes(frames[2], "big")] = frames[3]
        assert {s: replayed[s] for s in seqs} == live                 # byte-identical
    finally:
        dealer.close(linger=0)

    resp = await client.get("/kv_event_sources")
    assert (await resp.json()) == {"0": config.as_dict()}


async def test_the_pickers_decoder_reads_the_simulators_frames(sim_with_events):
    """The picker's own decoder (picker/signals/kvevents.py) gives the same events as the
    subscriber written from vLLM's schema above."""
    from picker.signals.kvevents import decode_message
    client, server, sub, *_ = sim_with_events
    first = await wait_subscribed(client, sub)
    await complete(client, " ".join(f"v{i}" for i in range(21)), max_tokens=9)
    frames = [first]
    while True:
        try:
            frames.append(await recv(sub, timeout=0.5))
        except asyncio.TimeoutError:
            break
    for frame in frames:
        topic, seq, batch = decode_message(frame)
        ours = DECODER.decode(frame[2])
        assert topic == "kv@sim-0" and seq == int.from_bytes(frame[1], "big")
        assert [type(e).__name__ for e in batch.events] == \
            [type(e).__name__.removeprefix("Vllm") for e in ours.events]
        for theirs, mine in zip(batch.events, ours.events):
            assert list(theirs.block_hashes) == mine.block_hashes
            if hasattr(mine, "token_ids"):
                assert list(theirs.token_ids) == mine.token_ids
                assert theirs.parent_block_hash == mine.parent_block_hash
    assert len(frames) >= 3


async def test_reset_prefix_cache_is_published_with_the_next_step(sim_with_events):
    client, server, sub, *_ = sim_with_events
    await wait_subscribed(client, sub)
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 200
    with pytest.raises(asyncio.TimeoutError):
        await recv(sub, timeout=0.2)                       # nothing until the next step
    await complete(client, "x y z w v")
    batch = DECODER.decode((await recv(sub))[2])
    assert isinstance(batch.events[0], VllmAllBlocksCleared)
    assert isinstance(batch.events[1], VllmBlockStored)


async def test_with_the_models_tokenizer_events_carry_its_token_ids(sims, model_tokenizer):
    """Completions encode with the tokenizer, chat renders its template first; the stored
    blocks' token ids are the tokenizer's, so a subscriber tokenizing the same text agrees."""
    client, server, sub, *_ = await start_sim(sims, tokenizer=model_tokenizer)
    await wait_subscribed(client, sub)
    prompt = "the model thinks about this step and then answers with a short note on each part"
    ids = model_tokenizer.tokenizer.encode(prompt).ids
    assert len(ids) == len(prompt.split())                 # the tiny model: one word, one token
    body = {"model": "qwq", "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    usage = (await (await client.post("/v1/completions", json=body)).json())["usage"]
    assert usage["prompt_tokens"] == len(ids)
    (stored,) = DECODER.decode((await recv(sub))[2]).events
    assert stored.token_ids == ids[:len(ids) // 4 * 4]

    messages = [{"role": "system", "content": "answer with a short note"},
                {"role": "user", "content": [{"type": "text", "text": "the question"}]}]
    text = model_tokenizer.render_chat(messages)
    assert text.startswith("<|im_start|>system\nanswer") and text.endswith("<|im_start|>assistant\n")
    chat_ids = model_tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    body = {"model": "qwq", "messages": messages, "max_tokens": 1, "ignore_eos": True}
    usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
    assert usage["prompt_tokens"] == len(chat_ids)
    (stored,) = DECODER.decode((await recv(sub))[2]).events
    assert stored.token_ids == chat_ids[:len(chat_ids) // 4 * 4]


def test_a_missing_tokenizer_directory_is_a_clear_error(tmp_path):
    from local.sim.tokenizer import ModelTokenizer
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ModelTokenizer(tmp_path)
