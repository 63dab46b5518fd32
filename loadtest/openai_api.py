"""OpenAI request bodies and the SSE stream decoder (no locust/gevent imports here)."""
from __future__ import annotations

import json

from loadtest.prompts import PromptSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
OBJECTIVE_HEADER = "x-gateway-inference-objective"


def request_body(spec: PromptSpec, endpoint: str, model: str, *, ignore_eos: bool = True) -> dict:
    """Streaming request like vLLM's benchmark client (usage in the last chunk).

    A spec with a cap hides its length as a real client's request does: max_tokens is the cap,
    and `min_tokens` (a vLLM sampling parameter) is the length, which the simulator takes as the
    point where its model's answer ends (local/sim/server.py); the picker never reads it."""
    limit = spec.output_tokens if spec.cap is None else spec.cap
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": 0.0, "ignore_eos": ignore_eos and spec.cap is None}
    if spec.cap is not None:
        body["min_tokens"] = spec.output_tokens
    if endpoint == "completions":
        body.update(prompt=spec.prompt, max_tokens=limit)
    elif endpoint == "chat":
        body.update(messages=spec.chat_messages(), max_completion_tokens=limit)
    else:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if spec.extra:
        body.update(spec.extra)
    return body


class SSEError(Exception):
    """The stream is not valid OpenAI SSE (the request counts as failed with this reason)."""


DONE = object()


class SSEDecoder:
    """Line-by-line SSE decoder: `feed(line)` returns a decoded JSON event, DONE, or None.

    Events end at a blank line; `:` lines are comments; several `data:` lines of one event are
    joined with newlines (SSE spec). An `{"error": ...}` event raises SSEError with its message.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self.done = False

    def feed(self, raw: bytes | str):
        line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: carry nothing vLLM uses

    def close(self):
        """End of the byte stream: dispatch a last event that had no trailing blank line."""
        return self._dispatch()

    def _dispatch(self):
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == "[DONE]":
            self.done = True
            return DONE
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as err:
            raise SSEError(f"broken SSE: not JSON ({err.msg}): {payload[:80]!r}") from None
        if not isinstance(event, dict):
            raise SSEError(f"broken SSE: event is not an object: {payload[:80]!r}")
        if "error" in event and not event.get("choices"):
            err = event["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise SSEError(f"server error in stream: {msg}")
        return event


def error_reason(status: int, body: bytes | str | None) -> str:
    """Short failure reason for a non-200 answer: status, the error's code when it names one
    (the picker's `queue_timeout`...: `HTTP 503 (queue_timeout): ...`), the server's message."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else (body or "")
    code = ""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            err = parsed.get("error", parsed.get("message", parsed))
            text = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"]:
                code = f" ({err['code']})"
    except json.JSONDecodeError:
        pass
    text = " ".join(text.split())[:200]
    return f"HTTP {status}{code}: {text}" if text else f"HTTP {status}{code}"
