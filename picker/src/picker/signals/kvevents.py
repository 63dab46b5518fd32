"""Decode vLLM's KV-cache events (`--kv-events-config`, publisher `zmq`) from the wire.

Written from vLLM's schema (`vllm/distributed/kv_events.py`, msgspec Structs), not from any
publisher in this repository. One ZMQ message has 3 frames:

    topic (UTF-8, may be empty) | sequence (8 bytes, big-endian, from 0 per server start) | payload

The payload is msgpack: the batch `[ts, events, data_parallel_rank]` (array-encoded; the rank
is missing in the oldest versions). Each event is tagged by its kind, in one of two encodings:

- a map with a `type` key (vLLM 0.28 and later: the `KVCacheEvent` Struct without array_like);
- an array whose first element is the tag (`array_like=True`: vLLM 0.9 up to 0.27, e.g. the
  v0.11.0 the manifests pinned before v0.32.0), the fields in declaration order, later versions
  adding fields at the end.

Fields read: `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx)`, `BlockRemoved(block_hashes, medium, group_idx)`,
`AllBlocksCleared()`; fields added by newer versions are ignored. Block hashes are unsigned
64-bit integers (often above 2**63) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, bytes: both
are kept as they come, they are only compared with each other.

An event with an unknown tag is skipped and counted (a newer vLLM may add kinds); anything else
that does not fit the schema makes the whole batch a KVEventsError: applying part of a batch
would leave the index wrong without anyone knowing.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]

# msgpack type bytes of a map: fixmap, map16, map32
_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the replay socket's last message
SEQ_BYTES = 8


class KVEventsError(ValueError):
    """A message or payload that does not fit vLLM's schema."""


class KVCacheEvent(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, gc=False):
    """Base of the three kinds (map-encoded form)."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


# The array-encoded form: the same classes (isinstance holds), fields by position.
class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


MapEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
ArrayEvent = Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]
Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class EventBatch(msgspec.Struct, gc=False):
    """One decoded payload. `unknown`: events skipped for an unknown tag."""
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0


_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_ARRAY_BATCH = msgspec.msgpack.Decoder(_ArrayBatch)
_RAW_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_MAP_EVENT = msgspec.msgpack.Decoder(MapEvent)
_ARRAY_EVENT = msgspec.msgpack.Decoder(ArrayEvent)
_ANY = msgspec.msgpack.Decoder()


def decode_payload(payload: bytes | memoryview) -> EventBatch:
    """The msgpack payload of one message -> EventBatch; KVEventsError if it is malformed."""
    for fast in (_MAP_BATCH, _ARRAY_BATCH):  # the whole batch in one call: the usual case
        try:
            batch = fast.decode(payload)
            return EventBatch(batch.ts, batch.events, batch.data_parallel_rank)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # the other encoding, an unknown kind or a malformed batch: one by one
    try:
        raw = _RAW_BATCH.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventsError(f"not a KV event batch [ts, events, rank]: {exc}") from None
    events: list[Event] = []
    unknown = 0
    for i, item in enumerate(raw.events):
        head = bytes(memoryview(item)[:1])
        decoder = _MAP_EVENT if head and head[0] in _MAP_FIRST else _ARRAY_EVENT
        try:
            events.append(decoder.decode(item))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            tag = _tag(item)
            if tag is not None and tag not in KNOWN_TAGS:
                unknown += 1
                continue
            raise KVEventsError(f"event {i}: {exc}") from None
    return EventBatch(raw.ts, events, raw.data_parallel_rank, unknown)


def _tag(item: msgspec.Raw) -> str | None:
    """The tag of an event that failed to decode, if it has a string one."""
    try:
        value = _ANY.decode(item)
    except msgspec.DecodeError:
        return None
    tag = value.get("type") if isinstance(value, dict) else (
        value[0] if isinstance(value, list) and value else None)
    return tag if isinstance(tag, str) else None


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KVEventsError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes]) -> tuple[str, int, EventBatch]:
    """A live message [topic, seq, payload] -> (topic, seq, batch)."""
    if len(frames) != 3:
        raise KVEventsError(f"{len(frames)} frames, expected 3 (topic, sequence, payload)")
    topic, seq, payload = frames
    return topic.decode("utf-8", "replace"), decode_seq(seq), decode_payload(payload)


def split_replay(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A message from the replay socket, as a DEALER receives it: [b"", (topic,) seq, payload]
    (vLLM 0.32 includes the topic, older versions do not). Returns (seq, payload), or None for
    the end marker (seq -1, empty payload)."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2:
        raise KVEventsError(f"replay message of {len(frames)} frames")
    seq, payload = frames
    if seq == END_OF_REPLAY:
        return None
    return decode_seq(seq), payload


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay (ROUTER) socket: every buffered batch from start_seq."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
