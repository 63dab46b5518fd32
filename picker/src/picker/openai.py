"""Read the parts of an OpenAI request body that routing needs, with clear 400s for bad input.

Token counts are approximated as ceil(characters / 4), the same ratio the upstream endpoint picker
uses to size prefix blocks (16 tokens = 64 characters); no tokenizer is loaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from picker.errors import PickerError

CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class ParsedRequest:
    obj: dict[str, Any]
    model: str
    prompt: str          # text used for prefix hashing
    prompt_tokens: int   # approximate
    max_tokens: int | None


def _bad(message: str, code: str = "invalid_request") -> PickerError:
    return PickerError(400, message, code)


def _message_text(messages: Any) -> str:
    if not isinstance(messages, list):
        raise _bad("'messages' must be an array", "invalid_type")
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"'messages[{i}]' must be an object", "invalid_type")
        role = msg.get("role", "")
        content = msg.get("content", "")
        if not isinstance(role, str):
            raise _bad(f"'messages[{i}].role' must be a string", "invalid_type")
        parts.append(role)
        parts.append(":")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
        elif content is not None:
            raise _bad(f"'messages[{i}].content' must be a string or an array", "invalid_type")
        parts.append("\n")
    return "".join(parts)


def _prompt_text(prompt: Any) -> tuple[str, int]:
    if isinstance(prompt, str):
        return prompt, -(-len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            text = "".join(prompt)
            return text, -(-len(text) // CHARS_PER_TOKEN)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)  # token ids: exact count
    raise _bad("'prompt' must be a string, an array of strings or an array of token ids",
               "invalid_type")


def parse_body(body: bytes) -> ParsedRequest:
    try:
        text = body.decode("utf-8")  # JSON over HTTP is UTF-8; json.loads(bytes) would guess UTF-16/32
    except UnicodeDecodeError:
        raise _bad("request body is not valid UTF-8", "invalid_utf8") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"request body is not valid JSON: {str(exc)[:200]}", "invalid_json") from None
    if not isinstance(obj, dict):
        raise _bad("request body must be a JSON object", "invalid_type")
    model = obj.get("model")
    if model is None:
        raise _bad("'model' is missing from the request body", "missing_model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "invalid_type")
    max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 0):
        raise _bad("'max_tokens' must be a non-negative integer", "invalid_type")
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "invalid_type")
    if "messages" in obj:
        prompt = _message_text(obj["messages"])
        tokens = -(-len(prompt) // CHARS_PER_TOKEN)
    elif "prompt" in obj:
        prompt, tokens = _prompt_text(obj["prompt"])
    else:
        prompt, tokens = "", 0
    return ParsedRequest(obj, model, prompt, tokens, max_tokens)


def rewrite_model(parsed: ParsedRequest, target: str) -> bytes:
    obj = dict(parsed.obj)      # the parsed body stays as sent (decide() may use it again)
    obj["model"] = target
    return json.dumps(obj, separators=(",", ":")).encode()  # ASCII-safe: lone surrogates survive
