"""How the simulator turns a request into token ids: the model's own tokenizer, or word counting.

`ModelTokenizer(DIR)` loads a Hugging Face tokenizer directory as vLLM does: `tokenizer.json`
with the `tokenizers` library, and the chat template of `tokenizer_config.json` rendered with
jinja2 the way `transformers` renders it (sandboxed, `trim_blocks`, `lstrip_blocks`). Completions
encode the prompt with the tokenizer's special tokens (vLLM's default for completions); chat
requests render the template with `add_generation_prompt=True` and encode the result without
adding special tokens (vLLM's default for chat). A message's content given as a list of text parts
is joined with newlines, as vLLM does for templates that take string content.

`WordTokenizer()` is the simulator's convention without a tokenizer (local/sim/tokens.py: one
word, one token). Both expose `prompt_ids(text)`, `chat_ids(messages)` and
`output_token(seed, index)` (the id of the word the server streams as generated token `index`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from local.sim import tokens


class WordTokenizer:
    name = "words"

    def prompt_ids(self, text: str) -> list[int]:
        return tokens.token_ids(text)

    def chat_ids(self, messages: Iterable[dict]) -> list[int]:
        return tokens.chat_token_ids(messages)

    def output_token(self, seed: int, index: int) -> int:
        return tokens.word_id(tokens.filler_word(seed, index))


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError("message content must be a string or a list of parts")


def _special(value: Any) -> str:
    """bos/eos in tokenizer_config.json: a string or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


class ModelTokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer        # imported here: only a simulator given one needs it

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {d}")
        self.name = str(d)
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = d / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):           # named templates: use "default"
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        self.bos_token = _special(config.get("bos_token"))
        self.eos_token = _special(config.get("eos_token"))
        self.template = self._compile(template) if template else None
        self._filler_ids = [self._word_id(w) for w in tokens.FILLER]
        self._filler_index = {w: i for i, w in enumerate(tokens.FILLER)}

    @staticmethod
    def _compile(source: str):
        from jinja2 import ext
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(source)

    def _word_id(self, word: str) -> int:
        ids = self.tokenizer.encode(word, add_special_tokens=False).ids
        return ids[-1] if ids else 0

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Iterable[dict]) -> str:
        if self.template is None:
            raise ValueError("the tokenizer has no chat template (tokenizer_config.json "
                             "chat_template); chat requests cannot be served")
        conversation = [{"role": str(m.get("role", "")), "content": _text(m.get("content"))}
                        for m in messages]
        return self.template.render(messages=conversation, add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def chat_ids(self, messages: Iterable[dict]) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def output_token(self, seed: int, index: int) -> int:
        return self._filler_ids[self._filler_index[tokens.filler_word(seed, index)]]


def load_tokenizer(directory: str | Path | None):
    """The model's tokenizer from `directory`, or word counting when None."""
    return WordTokenizer() if directory is None else ModelTokenizer(directory)
