"""KV-cache events of the live vLLM, read by the picker's own subscriber and decoder
(picker/src/picker/kvsubscriber.py, signals/kvevents.py, signals/kvstate.py): the picker finds
the publisher through vLLM's /kv_event_sources, follows it live and through the replay socket,
and ends up holding exactly the full blocks of a prompt the engine computed. Over 30 s: the first
test waits for the live vLLM's start (its CPU build: torch import and model load, up to a minute
on 2 busy cores)."""

from __future__ import annotations

import json
import time

from picker.kvsubscriber import KVSubscriber, resolve_source
from picker.signals.kvevents import BlockStored, decode_message
from picker.signals.kvstate import chain_hashes
from tests.conformance.exchanges import words
from tests.conformance.test_metrics import fetch

BLOCK = 128                     # the CPU backend's block size (cache_config_info)


def _blocks(sub: KVSubscriber, address: str, held: set[int], timeout: float = 60.0,
            until=None) -> tuple[set[int], dict]:
    """Apply the subscriber's deltas for `address` to `held` until `until(held)` holds."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        deltas, status = sub.take()
        for addr, in_sync, _reason, _block_size, added, removed in deltas:
            if addr == address:
                held -= set(removed)
                held |= set(added)
        if until is not None and until(held):
            return held, status
        time.sleep(0.05)
    return held, status


def test_picker_follows_live_vllm_kv_events(live_vllm):
    address = live_vllm.address
    sources = json.loads(fetch(address, "/kv_event_sources"))
    pub, replay = resolve_source(address, sources)
    if live_vllm.kv_events_port is not None:
        assert pub.endswith(f":{live_vllm.kv_events_port}")
        assert replay.endswith(f":{live_vllm.kv_replay_port}")

    live = KVSubscriber()
    live.start()
    try:
        live.subscribe(address, pub, replay)
        held, _ = _blocks(live, address, set(), timeout=30,
                          until=lambda h: live.tracker.endpoints.get(address) is not None
                          and live.tracker.endpoints[address].in_sync)
        assert live.tracker.endpoints[address].in_sync, "no replay answer from vLLM"

        prompt = words(3 * BLOCK + 50, 1500)      # 3 full blocks, the rest stays unpublished
        ids = json.loads(fetch(address, "/tokenize", {"model": "qwq", "prompt": prompt}))["tokens"]
        assert len(ids) == 3 * BLOCK + 50
        fetch(address, "/v1/completions", {"model": "qwq", "prompt": prompt, "max_tokens": 2,
                                           "ignore_eos": True})
        want = set(chain_hashes(ids, BLOCK))
        assert len(want) == 3
        held, status = _blocks(live, address, held, until=lambda h: want <= h)
        assert want <= held, "the prompt's blocks never arrived on the live subscription"
        ep = live.tracker.endpoints[address]
        assert ep.in_sync and ep.block_size == BLOCK
        assert (ep.stats.malformed, ep.stats.unknown, ep.stats.gaps) == (0, 0, 0)
    finally:
        live.stop()

    # a subscriber that joins later learns the same blocks from the replay socket alone
    late = KVSubscriber()
    late.start()
    try:
        late.subscribe(address, pub, replay)
        late_held, _ = _blocks(late, address, set(), until=lambda h: want <= h)
        assert want <= late_held, "the replay did not give the prompt's blocks"
        assert late.tracker.endpoints[address].stats.replays >= 1
    finally:
        late.stop()


def test_raw_frames_of_live_vllm_decode(live_vllm):
    """Three frames (topic `kv`, 8-byte sequence, msgpack batch) as the decoder expects, and a
    BlockStored of the CPU backend's block size with the prompt's token ids."""
    import zmq
    address = live_vllm.address
    pub, _ = resolve_source(address, json.loads(fetch(address, "/kv_event_sources")))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pub)
    try:
        prompt = words(BLOCK + 10, 2600)
        ids = json.loads(fetch(address, "/tokenize", {"model": "qwq", "prompt": prompt}))["tokens"]
        stored = []
        deadline = time.monotonic() + 60
        sent = False
        while time.monotonic() < deadline and not stored:
            if not sent:
                time.sleep(0.5)   # a SUB socket misses what is published before it connects
                fetch(address, "/v1/completions", {"model": "qwq", "prompt": prompt,
                                                   "max_tokens": 1})
                sent = True
            if sock.poll(200):
                topic, seq, batch = decode_message(sock.recv_multipart())
                assert topic == "kv" and seq >= 0
                stored += [e for e in batch.events if isinstance(e, BlockStored)
                           and list(e.token_ids) == ids[:BLOCK]]
        assert stored, "no BlockStored with the prompt's first block"
        assert stored[0].block_size == BLOCK and len(stored[0].block_hashes) == 1
    finally:
        sock.close()
