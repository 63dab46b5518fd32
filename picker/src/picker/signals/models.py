"""Parse an OpenAI-compatible /v1/models answer: the model and LoRA adapter names a server
accepts. vLLM lists its served model names and every loaded adapter (from --lora-modules or
loaded at run time), busy or idle; /metrics only names adapters that are running or waiting."""
from __future__ import annotations

import json

MAX_MODELS = 1024  # a server listing more is misconfigured; the rest are ignored


class ModelsParseError(ValueError):
    """The text is not a /v1/models list."""


def parse_models(text: str | bytes) -> frozenset[str]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ModelsParseError(f"/v1/models is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelsParseError("/v1/models has no `data` list")
    return frozenset(m["id"] for m in data[:MAX_MODELS]
                     if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"])
