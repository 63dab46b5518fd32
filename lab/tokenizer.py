"""The lab's tokenizer: the tiny model's (local/tinymodel), the one the local stack's simulators
and picker use, so that the engines' KV-cache events and the picker's own tokenization agree in
the lab as they do on the stack. Every load-test word is one token in it, so token counts (and
so every engine's schedule) are those of the simulator's word convention.

Built on first use into local.tinymodel.DEFAULT_DIR (deterministic, under a second), and again
when the builder's code changed (local.tinymodel.tokenizer.ensure_tokenizer).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from local.sim.tokenizer import ModelTokenizer
from local.tinymodel import DEFAULT_DIR
from local.tinymodel.tokenizer import ensure_tokenizer


def tokenizer_dir(directory: Path = DEFAULT_DIR) -> Path:
    return ensure_tokenizer(directory)


@functools.lru_cache(maxsize=1)
def lab_tokenizer() -> ModelTokenizer:
    return ModelTokenizer(tokenizer_dir())


_SINGLE_SPACED = re.compile(r"[^\s]+(?: [^\s]+)*")


class _WordIds:
    """Token ids of single-space-separated words, one word at a time, remembered.

    The byte-level pre-tokenizer splits such text at each space (the space goes with the word after
    it) and BPE never merges across that split, so the ids of the text are the ids of its first
    word followed by those of " word" for every other word. The workloads' prompts are a few
    thousand distinct words repeated millions of times: looking each up once is exact and ~20x
    cheaper than tokenizing the whole text (tests check the equality on every workload)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.first: dict[str, list[int]] = {}
        self.rest: dict[str, list[int]] = {}

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def ids(self, prompt: str) -> list[int]:
        words = prompt.split(" ")
        head = self.first.get(words[0])
        if head is None:
            head = self.first[words[0]] = self._encode(words[0])
        out = list(head)
        rest = self.rest
        for w in words[1:]:
            ids = rest.get(w)
            if ids is None:
                ids = rest[w] = self._encode(" " + w)
            out.extend(ids)
        return out


@functools.lru_cache(maxsize=1)
def _word_ids() -> _WordIds:
    return _WordIds(lab_tokenizer().tokenizer)


def prompt_token_ids(prompts: list[str]) -> list[list[int]]:
    """Completions' token ids as the engine (and the picker) compute them: the tokenizer's, with
    special tokens (the tiny model adds none), single-spaced word prompts through _WordIds."""
    tok = lab_tokenizer().tokenizer
    if tok.encode("", add_special_tokens=True).ids:          # a tokenizer that adds tokens
        return [e.ids for e in tok.encode_batch(prompts, add_special_tokens=True)]
    words = _word_ids()
    out = []
    for p in prompts:
        out.append(words.ids(p) if _SINGLE_SPACED.fullmatch(p)
                   else tok.encode(p, add_special_tokens=True).ids)
    return out
