"""The KV-event frames a real vLLM 0.32.0 server published (../shared/vllm-samples/, captured
with its own tooling), and vLLM's own encodings built with msgspec from its published schema."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

SAMPLES = Path(__file__).resolve().parents[2].parent / "shared" / "vllm-samples"
CAPTURE = SAMPLES / "kv-events-vllm-0.32.0.jsonl"


def capture() -> list[dict]:
    if not CAPTURE.is_file():
        pytest.skip(f"{CAPTURE} absent")
    return [json.loads(line) for line in CAPTURE.read_text().splitlines() if line.strip()]


def payload(line: dict) -> bytes:
    return base64.b64decode(line["payload_b64"])


def messages(run: str, source: str = "pub") -> list[dict]:
    return [m for m in capture() if m["run"] == run and m["source"] == source
            and m.get("payload_len")]


# vLLM 0.9-0.11's schema (vllm/distributed/kv_events.py): array_like structs, tag first. Written
# here to produce what such an engine sends; the picker's decoder has its own definitions.
class V011Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V011BlockStored(V011Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class V011BlockRemoved(V011Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class V011AllBlocksCleared(V011Event, tag="AllBlocksCleared"):
    pass


class V011Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[V011BlockStored | V011BlockRemoved | V011AllBlocksCleared]
    data_parallel_rank: int | None = None


def v011_payload(events: list, ts: float = 1.7e9, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode(V011Batch(ts, events, rank))


def map_payload(events: list[dict], ts: float = 1.7e9, rank: int | None = 0) -> bytes:
    """The 0.32 form: events as maps tagged by `type`."""
    return msgspec.msgpack.encode([ts, events, rank])


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
           **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": 0, **extra}


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def cleared() -> dict:
    return {"type": "AllBlocksCleared"}
