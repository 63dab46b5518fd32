"""The simulator's tokenizer convention (shared by the simulator, the lab and the load tests).

One whitespace-separated word is one token. Each word maps to a stable integer id (CRC-32 of its
UTF-8 bytes), so ids are equal across processes and runs (Python's str hash is randomised; CRC-32
is not). A chat request counts the tokens of every message's content plus a fixed template
overhead (chat_token_ids): 5 per message (`<|im_start|>`, role, newline, `<|im_end|>`, newline)
and 3 once for the assistant turn: ChatML's framing, as the tiny model's chat template renders it
(so real vLLM serving that model counts the same).
Load-test workloads generate prompts as words, so their token counts match the simulator's usage.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Iterable

# Fixed ids for the chat template's framing tokens (outside CRC-32's use by words only by chance,
# which is harmless: ids only feed the prefix-cache block hashes).
_IM_START, _IM_END, _NEWLINE, _ASSISTANT = 1 << 33, (1 << 33) + 1, (1 << 33) + 2, (1 << 33) + 3


def word_id(word: str) -> int:
    return zlib.crc32(word.encode())


def count_tokens(text: str) -> int:
    return len(text.split())


def token_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode()) for w in text.split()]


def message_text(content: Any) -> str:
    """Text of an OpenAI message `content`: a string or a list of parts ({type: text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of parts")


def chat_token_ids(messages: Iterable[dict]) -> list[int]:
    """Token ids of a chat prompt: framing per message, content words, and the reply primer."""
    ids: list[int] = []
    for m in messages:
        ids.append(_IM_START)
        ids.append(word_id(str(m.get("role", ""))))
        ids.append(_NEWLINE)
        ids.extend(token_ids(message_text(m.get("content"))))
        ids.extend((_IM_END, _NEWLINE))
    ids.extend((_IM_START, _ASSISTANT, _NEWLINE))
    return ids


FILLER = ("the", "model", "thinks", "about", "this", "step", "and", "then", "answers", "with",
          "a", "short", "note", "on", "each", "part", "of", "question", "so", "we", "can",
          "check", "result", "again")


def filler_word(seed: int, index: int) -> str:
    """Deterministic output word number `index` of a response whose stream seed is `seed`."""
    return FILLER[(seed * 7 + index * 13 + (index >> 3)) % len(FILLER)]


FILLER_IDS = tuple(word_id(w) for w in FILLER)


def filler_word_id(seed: int, index: int) -> int:
    """word_id(filler_word(seed, index)) without hashing the word again (the engine model hashes
    every block of generated tokens)."""
    return FILLER_IDS[(seed * 7 + index * 13 + (index >> 3)) % len(FILLER)]


def filler_word_ids(seed: int, start: int, stop: int) -> tuple[int, ...]:
    """tuple(filler_word_id(seed, i) for i in range(start, stop)). Word i + d of a stream is
    FILLER[(offset + 13 d + ((start % 8 + d) >> 3)) % 24] with offset the index of word `start`,
    so a run of words depends only on (offset, start % 8, length): cached on those."""
    return _filler_run((seed * 7 + start * 13 + (start >> 3)) % len(FILLER), start % 8,
                       stop - start)


@functools.lru_cache(maxsize=8192)
def _filler_run(offset: int, phase: int, length: int) -> tuple[int, ...]:
    n = len(FILLER)
    return tuple(FILLER_IDS[(offset + d * 13 + ((phase + d) >> 3)) % n]
                 for d in range(max(0, length)))
