"""A stand-in for vLLM's KV-events publisher (vllm/distributed/kv_events.py ZmqEventPublisher),
with real ZMQ sockets on loopback: PUB for the live batches [topic, seq(8B), payload], ROUTER for
replays (a DEALER's [b"", start(8B)] -> every buffered batch >= start as [b"", topic, seq,
payload], then [b"", b"", -1, b""]). Tests decide what it publishes, drops or never answers."""
from __future__ import annotations

import threading
import time

import zmq


class StandInPublisher:
    def __init__(self, topic: bytes = b"kv", replay: bool = True, answer_replays: bool = True):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = None
        self.router = None
        self.answer_replays = answer_replays
        self.replay_requests: list[int] = []
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_url(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def publish(self, payload: bytes, live: bool = True, frames: list[bytes] | None = None) -> int:
        """Buffer (for replays) and, if `live`, send one batch; returns its sequence number."""
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if live:
                self.pub.send_multipart(frames or [self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def _serve(self) -> None:
        if self.router is None:
            return
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop_event.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            if not self.answer_replays:
                continue
            with self.lock:
                for seq, payload in self.buffer:
                    if seq >= start:
                        self.router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"),
                                                    payload])
                self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                            b""])

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(2)
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()


def until(cond, timeout: float = 10.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()
