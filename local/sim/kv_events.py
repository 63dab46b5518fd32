"""vLLM's KV-cache event publisher for the simulator: ZMQ PUB + replay ROUTER, vLLM's wire format.

The engine core records `BlockStored` / `BlockRemoved` / `AllBlocksCleared` as its allocator acts
(local/sim/engine.py); the HTTP server drains them after every engine step and publishes the
step's events as one batch here, as vLLM's engine core does. The format is the one a real
vLLM 0.32 server sends (captured frames and notes: the project's vLLM samples):

- PUB socket, 3 frames per message: topic (UTF-8), sequence (8-byte big-endian, from 0 at every
  start, one per batch), payload (msgpack `[ts, [event, ...], data_parallel_rank]`);
- events are msgpack maps whose first key `type` names the kind, with vLLM's keys in vLLM's
  order; block hashes are unsigned 64-bit integers;
- replay: a ROUTER socket; a DEALER sends `[b"", start_seq (8 bytes BE)]` and gets one message
  `[b"", topic, seq, payload]` per buffered batch with seq >= start (payloads byte-identical to
  the live ones), then the end marker `[b"", b"", 0xff * 8, b""]`. The buffer keeps the last
  `buffer_steps` batches.

Configuration is the JSON of vLLM's `--kv-events-config` (`KVEventsConfig`). Endpoints follow
vLLM's rule for the PUB socket: a wildcard address (`*`, `::`, `0.0.0.0`) or ipc/inproc is bound,
any other address is connected to, except that the simulator binds loopback addresses too (so
the local stack keeps every socket on 127.0.0.1; vLLM would connect to them). The replay
endpoint is always bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Optional, Sequence

import msgspec
import zmq
import zmq.asyncio

from local.sim.engine import AllBlocksCleared, BlockRemoved, BlockStored

log = logging.getLogger("local.sim.kv_events")

END_OF_REPLAY = (2**64 - 1).to_bytes(8, "big")       # -1 as a signed 8-byte integer
MEDIUM = "GPU"                                       # what vLLM sends, even on its CPU build


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (the fields of `--kv-events-config`, with vLLM's defaults)."""
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None        # "zmq" | "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse `--kv-events-config`; ValueError naming the field on anything vLLM would refuse."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--kv-events-config is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        types = {"enable_kv_cache_events": (bool,), "publisher": (str, type(None)),
                 "endpoint": (str,), "replay_endpoint": (str, type(None)),
                 "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
                 "topic": (str,)}
        for name, value in raw.items():
            ok = isinstance(value, types[name])
            if ok and types[name] == (int,) and (isinstance(value, bool) or value < 1):
                ok = False
            if not ok:
                raise ValueError(f"--kv-events-config: field {name!r} has a bad value "
                                 f"{value!r}")
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not "
                             f"supported (zmq or null)")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(config, name)
            if value is not None and "://" not in value:
                raise ValueError(f"--kv-events-config: {name} {value!r} is not a ZMQ address "
                                 f"(tcp://HOST:PORT)")
        return config

    def as_dict(self) -> dict:
        return asdict(self)


def event_map(event) -> dict:
    """One engine event as vLLM 0.32 encodes it (a map tagged by `type`, vLLM's key order)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                "block_size": event.block_size, "lora_id": None, "medium": MEDIUM,
                "lora_name": None, "extra_keys": [None] * len(event.block_hashes),
                "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": MEDIUM,
                "group_idx": 0}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV-cache event: {event!r}")


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: Sequence, ts: float, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one batch: `[ts, [event map, ...], data_parallel_rank]`."""
    return _encoder.encode([float(ts), [event_map(e) for e in events], data_parallel_rank])


def _binds(endpoint: str) -> bool:
    """vLLM's rule (bind wildcards and ipc/inproc, connect to anything else), plus loopback."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("*", "::", "0.0.0.0", "localhost", "::1") or host.startswith("127.")


class EventPublisher:
    """Publishes batches on the PUB socket and answers replay requests (runs in an asyncio loop).

    `publish` never blocks (a PUB socket drops messages past its high-water mark, as vLLM's does);
    every batch is also kept in the replay buffer.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: Optional[zmq.asyncio.Context] = None):
        self.config = config
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self.ctx = context or zmq.asyncio.Context.instance()
        self.buffer: deque = deque(maxlen=config.buffer_steps)    # (seq, payload)
        self.next_seq = 0
        self.pub: Optional[zmq.asyncio.Socket] = None
        self.replay: Optional[zmq.asyncio.Socket] = None
        self.replay_task: Optional[asyncio.Task] = None
        self.replays_served = 0

    def start(self) -> None:
        """Open the sockets (call inside the running loop)."""
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.config.endpoint):
            pub.bind(self.config.endpoint)
        else:
            pub.connect(self.config.endpoint)
        self.pub = pub
        if self.config.replay_endpoint:
            replay = self.ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.config.replay_endpoint)
            self.replay = replay
            self.replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence, ts: Optional[float] = None) -> Optional[int]:
        """Publish one batch (one engine step's events); returns its sequence number. An empty
        batch is not published (vLLM publishes only steps that produced events)."""
        if not events:
            return None
        payload = encode_batch(events, time.time() if ts is None else ts, self.rank)
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload],
                                    flags=zmq.NOBLOCK)
        except zmq.Again:          # past the high-water mark: dropped, replay still has it
            log.warning("KV events: PUB queue full, batch %d dropped (replay keeps it)", seq)
        return seq

    async def _serve_replay(self) -> None:
        replay = self.replay
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: bad replay request with %d frame(s) ignored",
                            len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"),
                                                 payload])
            await replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])
            self.replays_served += 1

    async def close(self) -> None:
        if self.replay_task:
            self.replay_task.cancel()
            try:
                await self.replay_task
            except asyncio.CancelledError:
                pass
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
