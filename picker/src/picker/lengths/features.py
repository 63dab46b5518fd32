"""What a request shows about the length of its answer, before anyone has seen the answer.

Only fields the request carries (or its client's id, which the edge sets from the API key):

- `model`: the model or LoRA adapter it is routed to;
- `client`: `x-client-id`;
- `template` / `context`: fingerprints of the prompt's first 128 and 1,024 tokens (a system
  prompt, an application's template, a session's history), from the prefix hashes the picker
  computes anyway, or a hash of the text when the profile hashes no prefix;
- `cap`: the `max_tokens` / `max_completion_tokens` cap, by half octave ("-" when absent);
- `prompt`: the prompt's length, by half octave;
- `mode`: the API (completions / chat) and the reasoning and tool fields: `reasoning_effort`,
  `chat_template_kwargs.enable_thinking`, `tools`, `response_format`.

`Features.key()` packs them into one short string: the picker writes it into the request's
dynamic metadata, Envoy's access log carries it back with the outcome, and any replica can learn
from that outcome without having made the decision (`Features.from_key`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import xxhash

SEP = "\t"
FIELDS = ("model", "client", "template", "context", "cap", "prompt", "mode")
TEMPLATE_BLOCKS, CONTEXT_BLOCKS = 2, 16     # 64-token prefix blocks: 128 and 1,024 tokens
CHARS_PER_TOKEN = 4                         # as picker.openai counts
MAX_FIELD = 96                              # a client-chosen value is clipped to this
MAX_CAP = 1 << 24                           # caps above any context length count as this


def half_octave(n: int | None) -> str:
    """A length as its half-octave bucket: 0..1 -> "0", 1,000 -> "20", 2,000 -> "22"."""
    if n is None:
        return "-"
    return str(int(2 * math.log2(n))) if n > 1 else "0"


def _clean(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text.replace(SEP, " ")[:MAX_FIELD]


def _fingerprint(hashes: list[int], blocks: int, text: str) -> str:
    if hashes:
        return format(hashes[min(blocks, len(hashes)) - 1] & 0xFFFFFFFFFFFF, "x")
    return format(xxhash.xxh64_intdigest(text[:blocks * 64 * CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")) & 0xFFFFFFFFFFFF, "x")


def _mode(path: str, obj: dict) -> str:
    parts = ["chat" if "chat" in path else "text"]
    effort = obj.get("reasoning_effort")
    if effort is not None:
        parts.append(f"effort={_clean(effort)[:16]}")
    kwargs = obj.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and "enable_thinking" in kwargs:
        parts.append("think" if kwargs["enable_thinking"] else "nothink")
    if obj.get("tools"):
        parts.append("tools")
    fmt = obj.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("type"), str):
        parts.append(_clean(fmt["type"])[:16])
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class Features:
    model: str
    client: str
    template: str
    context: str
    cap: str
    prompt: str
    mode: str
    cap_tokens: int | None = None   # the cap itself (forecasts never exceed it); not in the key

    @property
    def prompt_octave(self) -> str:
        """The prompt's length by octave (two half-octave buckets together)."""
        return self.prompt if self.prompt == "-" else str(int(self.prompt) // 2)

    @classmethod
    def of(cls, path: str, headers: dict[str, str], obj: dict, model: str, prompt_text: str,
           prompt_tokens: int, max_tokens: int | None, hashes: list[int]) -> "Features":
        if max_tokens is not None:
            max_tokens = min(max_tokens, MAX_CAP)
        return cls(_clean(model), _clean(headers.get("x-client-id", "")),
                   _fingerprint(hashes, TEMPLATE_BLOCKS, prompt_text),
                   _fingerprint(hashes, CONTEXT_BLOCKS, prompt_text),
                   half_octave(max_tokens), half_octave(prompt_tokens), _mode(path, obj),
                   max_tokens)

    def key(self) -> str:
        cap = "" if self.cap_tokens is None else str(self.cap_tokens)
        return SEP.join((self.model, self.client, self.template, self.context, cap, self.prompt,
                         self.mode))

    @classmethod
    def from_key(cls, key: str) -> "Features | None":
        """The features a key() packed; None for anything else (a foreign or damaged value)."""
        parts = key.split(SEP)
        if len(parts) != len(FIELDS):
            return None
        model, client, template, context, cap, prompt, mode = parts
        try:
            cap_tokens = min(int(cap), MAX_CAP) if cap else None
        except ValueError:
            return None
        return cls(model, client, template, context, half_octave(cap_tokens), prompt, mode,
                   cap_tokens)
