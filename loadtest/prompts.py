"""What a load test sends: the prompt type every workload produces, and the synthetic words
prompts are made of.

Token counting: without the model's tokenizer we count **one whitespace-separated word as one
token**, which is the convention of the local vLLM simulator. Prompts are built from a fixed
vocabulary of short synthetic words joined by single spaces, so for the simulator the counts are
exact; against a real vLLM the real token count differs (a synthetic word is usually 1-3 BPE
tokens). Reports therefore account tokens with the server's `usage` field, never with these
counts; `PromptSpec.prompt_tokens` is only the workload's own intent.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptSpec:
    prompt: str            # completion prompt text (words separated by single spaces)
    prompt_tokens: int     # the workload's own count (1 whitespace word = 1 token)
    output_tokens: int     # max_tokens to request (sent with ignore_eos=True)
    group: str = ""        # shared-prefix group / tenant id ("" if none)
    messages: list | None = None  # for chat: OpenAI messages (None: one user message = prompt)
    arrival: float | None = None  # send time in s from the start (traces); None: the run decides
    client: str = ""       # the client that sends it (loadtest/clients.py; "" = the run's only one)
    # Realistic requests hide their answer's length: `cap` is the max_tokens the client sends
    # (>= output_tokens; None: output_tokens itself, with ignore_eos, as vLLM's benchmark does),
    # `extra` more body fields (reasoning_effort, chat_template_kwargs, tools, ...). What decides
    # the length stays with the workload: `length_class` names the request's class and
    # `length_dist` its class's length distribution (loadtest/lengths.py), known only to the lab's
    # distribution oracle and to reports.
    cap: int | None = None
    extra: dict | None = None
    length_class: str = ""
    length_dist: tuple | None = None

    def chat_messages(self) -> list:
        return self.messages if self.messages is not None else [
            {"role": "user", "content": self.prompt}]


_CONSONANTS = list("bdfgklmnprstvz")
_VOWELS = list("aeiou")


def _make_vocabulary() -> np.ndarray:
    """4,900 pronounceable two-syllable words, e.g. 'bada', 'zuto' (fixed, no randomness)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    return np.array([a + b for a in syllables for b in syllables])


VOCABULARY = _make_vocabulary()


def random_words(rng: np.random.Generator, n: int) -> str:
    """n random vocabulary words joined by single spaces (n = the simulator's token count)."""
    if n <= 0:
        return ""
    return " ".join(VOCABULARY[rng.integers(0, len(VOCABULARY), size=n)].tolist())


def join_parts(*parts: str) -> str:
    """The non-empty parts joined by single spaces."""
    return " ".join(p for p in parts if p)
