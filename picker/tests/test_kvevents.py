"""The KV-event decoder against a real vLLM's bytes (0.32 capture) and vLLM's older array form."""
from __future__ import annotations

import base64

import msgspec
import pytest

from kvsamples import (V011AllBlocksCleared, V011BlockRemoved, V011BlockStored, capture,
                       cleared, map_payload, messages, payload, removed, stored, v011_payload)
from picker.signals.kvevents import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventsError,
                                     decode_message, decode_payload, replay_request, split_replay)


def test_every_captured_message_decodes_as_vllm_shows_it():
    lines = [m for m in capture() if m.get("payload_len")]
    assert len(lines) >= 30
    for m in lines:
        batch = decode_payload(payload(m))
        raw = m["decoded"]  # msgspec's schema-less decode, recorded at capture time
        assert batch.ts == raw[0] and batch.data_parallel_rank == raw[2] == 0
        assert batch.unknown == 0
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in raw[1]]
        for ev, want in zip(batch.events, raw[1]):
            if isinstance(ev, BlockStored):
                assert ev.block_hashes == want["block_hashes"]
                assert ev.parent_block_hash == want["parent_block_hash"]
                assert ev.token_ids == want["token_ids"]
                assert ev.block_size == want["block_size"] == 128
                assert ev.medium == "GPU" and ev.group_idx == 0 and ev.lora_name is None
            elif isinstance(ev, BlockRemoved):
                assert ev.block_hashes == want["block_hashes"] and len(ev.block_hashes) == 1


def test_u64_hashes_above_2_63_survive():
    first = messages("default")[0]
    batch = decode_payload(payload(first))
    hashes = batch.events[0].block_hashes
    assert hashes[0] == 884404447267587196  # the README's first block, equal in every run
    assert any(h >= 2 ** 63 for h in hashes)
    assert all(0 <= h < 2 ** 64 for h in hashes)
    assert b"\xcf" in payload(first)  # encoded as msgpack uint64


def test_live_message_frames():
    m = messages("extras")[1]
    frames = [m["topic"].encode(), bytes.fromhex(m["sequence_hex"]), payload(m)]
    topic, seq, batch = decode_message(frames)
    assert (topic, seq) == ("kv", 1)
    ev = batch.events[0]
    assert ev.parent_block_hash == 3413975638439617560  # extends the cached prompt
    with pytest.raises(KVEventsError, match="expected 3"):
        decode_message(frames[:2])
    with pytest.raises(KVEventsError, match="8"):
        decode_message([b"kv", b"\x00\x01", payload(m)])


def test_replay_answer_and_end_marker():
    answer = [m for m in capture() if m["source"] == "replay" and m["run"] == "blocks64"]
    live = {m["sequence"]: payload(m) for m in messages("blocks64")}
    seqs = []
    for m in answer:
        frames = [b"", m["topic"].encode(), bytes.fromhex(m["sequence_hex"]),
                  base64.b64decode(m["payload_b64"])]
        got = split_replay(frames)
        if m.get("end_marker"):
            assert got is None
            continue
        seq, data = got
        assert data == live[seq]
        seqs.append(seq)
    assert seqs == list(range(1, 9))
    # older vLLM answers without the topic frame: [b"", seq, payload]
    assert split_replay([b"", (5).to_bytes(8, "big"), b"x"]) == (5, b"x")
    assert split_replay([b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]


def test_cleared_event():
    m = [m for m in messages("extras") if m["step"] == "after_reset"][0]
    batch = decode_payload(payload(m))
    assert len(batch.events) == 1 and isinstance(batch.events[0], AllBlocksCleared)


def test_array_encoded_events_of_older_vllm():
    big = 2 ** 64 - 1
    data = v011_payload([
        V011BlockStored([big, 5], None, list(range(32)), 16, None, "GPU"),
        V011BlockRemoved([big], "GPU"),
        V011AllBlocksCleared(),
    ])
    assert data[1:2] == b"\xcb"  # [ts, ...] array with a float64 first
    batch = decode_payload(data)
    a, b, c = batch.events
    assert isinstance(a, BlockStored) and a.block_hashes == [big, 5] and a.block_size == 16
    assert a.token_ids == list(range(32)) and a.medium == "GPU" and a.parent_block_hash is None
    assert isinstance(b, BlockRemoved) and b.block_hashes == [big]
    assert isinstance(c, AllBlocksCleared)
    # vLLM 0.9 had neither medium nor the rank; later versions add fields at the end
    oldest = msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [7] * 16, 16, None]]])
    assert decode_payload(oldest).events[0].medium is None
    newer = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU", 0, "new", 9]], 0])
    assert decode_payload(newer).events[0].block_hashes == [1]


def test_bytes_hashes_are_kept_as_bytes():
    data = map_payload([stored([b"\x01" * 32], b"\x02" * 32, [1] * 16, 16)])
    ev = decode_payload(data).events[0]
    assert ev.block_hashes == [b"\x01" * 32] and ev.parent_block_hash == b"\x02" * 32


def test_unknown_tags_are_counted_not_fatal():
    data = map_payload([stored([1], None, [3] * 16, 16), {"type": "BlockMoved", "x": 1},
                        removed([1])])
    batch = decode_payload(data)
    assert batch.unknown == 1
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    arr = msgspec.msgpack.encode([1.0, [["Defragmented", 1, 2], ["AllBlocksCleared"]], 0])
    batch = decode_payload(arr)
    assert batch.unknown == 1 and isinstance(batch.events[0], AllBlocksCleared)


@pytest.mark.parametrize("data, why", [
    (b"", "empty"),
    (b"\xc1", "reserved byte"),
    (msgspec.msgpack.encode({"ts": 1.0}), "a map, not the batch array"),
    (msgspec.msgpack.encode([1.0]), "no events"),
    (msgspec.msgpack.encode(["x", []]), "ts not a number"),
    (map_payload([{"type": "BlockStored", "block_hashes": "nope"}]), "hashes not a list"),
    (map_payload([{"type": "BlockRemoved"}]), "a known kind without its fields"),
    (map_payload([{"no_type": 1}]), "an event without a tag"),
    (map_payload([stored([1], None, ["a"], 16)]), "token ids not integers"),
    (map_payload([stored([1.5], None, [1] * 16, 16)]), "a hash that is a float"),
    (msgspec.msgpack.encode([1.0, [5], 0]), "an event that is a number"),
    (map_payload([cleared()])[:-3], "truncated"),
])
def test_malformed_batches_raise(data, why):
    with pytest.raises(KVEventsError):
        decode_payload(data)
