"""Find the `usage` object in a response: a JSON body, or the SSE chunk that carries it."""
from __future__ import annotations

import json
from typing import Any

MAX_JSON_BYTES = 4 * 1024 * 1024  # larger non-streamed bodies are not searched for usage


class UsageTracker:
    def __init__(self, content_type: str):
        self.sse = content_type.startswith("text/event-stream")
        self._buf = bytearray()
        self._partial = b""
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if not self.sse:
            if len(self._buf) + len(chunk) <= MAX_JSON_BYTES:
                self._buf += chunk
            else:
                self._buf = bytearray(b"x")  # too big: give up on this body
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-65536:]
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if line.startswith(b"data:") and b'"usage"' in line:
            self._take(line[5:])

    def _take(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]

    def finish(self) -> dict[str, Any] | None:
        if self.sse:
            if self._partial:
                self._line(self._partial)
        elif self._buf and b'"usage"' in self._buf:
            self._take(bytes(self._buf))
        return self.usage
