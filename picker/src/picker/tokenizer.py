"""The model's own tokenizer, so the picker's token ids are the engine's.

Read from a model directory (in the cluster the model volume, mounted read-only):
`tokenizer.json` (the `tokenizers` library) and `tokenizer_config.json` (special tokens and the
chat template; else `chat_template.jinja` / `chat_template.json`, as newer models ship them).

As vLLM's OpenAI server does:
- `/v1/completions`: the prompt text encoded with the tokenizer's special tokens (its
  post-processor adds a BOS where the model has one); a token-id prompt is taken as it is.
- `/v1/chat/completions`: the chat template rendered with `add_generation_prompt` (default
  true, as vLLM's), then encoded without special tokens (the template writes them). Message
  contents given as parts are joined with newlines (vLLM's "string" content format); a request
  with non-text parts (images, audio) is not tokenized: its blocks carry extra keys the picker
  cannot compute, so it is routed on the approximate index.
The template renders in Jinja2's sandbox with the options and helpers Hugging Face's
`apply_chat_template` gives templates (trim_blocks, lstrip_blocks, loopcontrols, `tojson`,
`raise_exception`, `strftime_now`).
"""
from __future__ import annotations

import json
import logging
from array import array
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import xxhash

log = logging.getLogger("picker.tokenizer")

# Windowed tokenization (ModelTokenizer.windows): windows of WINDOW characters, cut at the start
# of a pre-token at least MARGIN characters before the window's end; CACHE windows remembered.
WINDOW = 1024
MARGIN = 64
CACHE = 8192


class TokenizerError(ValueError):
    """The directory holds no usable tokenizer."""


class NotTokenizable(ValueError):
    """This request cannot be tokenized as the engine would (non-text input, bad template)."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_template(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = directory / "chat_template.json"
    if js.is_file():
        value = json.loads(js.read_text()).get("chat_template")
        return value if isinstance(value, str) else None
    return None


class ModelTokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer  # Rust; loaded only where precise routing is on
        d = Path(directory)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: missing")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the library raises plain Exception on a bad file
            raise TokenizerError(f"{tok_file}: {str(exc)[:200]}") from None
        try:
            config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{cfg_file}: {exc}") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{cfg_file}: not a JSON object")
        self.directory = d
        self.special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if (t := _token_text(config.get(k))) is not None}
        source = _read_template(d, config)
        self.template = self._compile(source) if source else None
        self._cache: OrderedDict[int, tuple[array, int]] = OrderedDict()
        self.windowed = self._windows_agree()

    @staticmethod
    def _compile(source: str):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise NotTokenizable(f"chat template: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise TokenizerError(f"chat template does not compile: {str(exc)[:200]}") from None

    # ---- requests ----------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list, add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        if self.template is None:
            raise NotTokenizable("the tokenizer has no chat template")
        conversation = [_text_message(m) for m in messages]
        try:
            return self.template.render(messages=conversation,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**self.special, **kwargs})
        except NotTokenizable:
            raise
        except Exception as exc:  # a template error on this request's messages
            raise NotTokenizable(f"chat template: {str(exc)[:200]}") from None

    def request_text(self, path: str, obj: dict) -> tuple[str | None, bool, list[int] | None]:
        """What the engine tokenizes for this OpenAI request body (already validated by
        openai.parse_body): (text, add_special_tokens, None), or (None, False, token ids) for a
        token-id prompt; NotTokenizable if that cannot be known."""
        if path.split("?", 1)[0].endswith("/chat/completions") or (
                "messages" in obj and "prompt" not in obj):
            messages = obj.get("messages")
            if not isinstance(messages, list):
                raise NotTokenizable("no messages")
            kwargs = obj.get("chat_template_kwargs")
            kwargs = kwargs if isinstance(kwargs, dict) else {}
            text = self.render_chat(messages, obj.get("add_generation_prompt", True) is not False,
                                    **{k: v for k, v in kwargs.items() if isinstance(k, str)
                                       and k not in ("messages", "add_generation_prompt")})
            return text, obj.get("add_special_tokens") is True, None
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: each is its own request to the engine
        if isinstance(prompt, str):
            return prompt, obj.get("add_special_tokens", True) is not False, None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            return None, False, prompt
        raise NotTokenizable("no text or token-id prompt")

    def request_tokens(self, path: str, obj: dict) -> list[int]:
        """The token ids the engine computes for this request (all of them, in one call)."""
        text, special, ids = self.request_text(path, obj)
        return ids if text is None else self.encode_text(text, special)

    def windows(self, text: str, add_special_tokens: bool) -> Iterator[tuple[list[int], int]]:
        """The text's token ids window by window: (ids, characters consumed so far). Joined,
        they are encode_text(text): each window is cut where a pre-token starts, well before
        its end, and the next one starts there (the pre-tokenizer's split of what follows does
        not depend on what came before it; checked on this tokenizer at load, `windowed`).
        Windows are cached by the chained hash of the text up to their end, so a prefix shared
        by many prompts (a tenant's system prompt) is tokenized once; the caller can stop
        early, when no engine holds the blocks so far."""
        n = len(text)
        if not self.windowed or n <= WINDOW + MARGIN:
            yield self.encode_text(text, add_special_tokens), n
            return
        pos, key, first = 0, 1 if add_special_tokens else 2, True
        cache = self._cache
        while n - pos > WINDOW + MARGIN:
            chunk = text[pos:pos + WINDOW]
            key = xxhash.xxh3_64_intdigest(chunk.encode("utf-8", "surrogatepass"), key)
            hit = cache.get(key)
            if hit is None:
                hit = self._cut(chunk, first and add_special_tokens)
                if hit is None:  # no pre-token starts in the window: the rest in one piece
                    break
                cache[key] = hit
                if len(cache) > CACHE:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(key)
            ids, advance = hit
            pos += advance
            first = False
            yield ids, pos
        yield self.encode_text(text[pos:], first and add_special_tokens), n

    def _cut(self, chunk: str, add_special_tokens: bool) -> tuple[array, int] | None:
        enc = self.tokenizer.encode(chunk, add_special_tokens=add_special_tokens)
        words, offsets = enc.word_ids, enc.offsets
        limit = len(chunk) - MARGIN
        for k in range(len(words) - 1, 0, -1):
            start = offsets[k][0]
            if start <= limit and words[k] is not None and words[k] != words[k - 1] \
                    and start > 0:
                return array("I", enc.ids[:k]), start
        return None

    def _windows_agree(self) -> bool:
        """Whether windowed tokenization gives exactly the whole text's tokens, on text with
        the usual troubles (spaces, newlines, digits, punctuation, non-ASCII, special tokens)."""
        pieces = ["Hello, world!", "  two  spaces", "tabs\tand\nnew\n\nlines", "x1234567 99",
                  "naïve café 東京 😀", "don't stop", "a-b_c/d.e", "<|im_start|>user\n"]
        pieces += [t for t in self.special.values()]
        text = " ".join(pieces[i % len(pieces)] for i in range(700))
        saved = self._cache
        self._cache, self.windowed = OrderedDict(), True
        try:
            for special in (True, False):
                got = [t for ids, _ in self.windows(text, special) for t in ids]
                if got != self.encode_text(text, special):
                    log.info("windowed tokenization disagrees with whole-text tokenization "
                             "for this tokenizer: whole prompts are tokenized")
                    return False
            return True
        finally:
            self._cache = saved


def _text_message(message: Any) -> Any:
    """A message with its content as one string (vLLM's "string" content format)."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" \
                    and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise NotTokenizable("a message part that is not text")
        return {**message, "content": "\n".join(parts)}
    return message


def load_tokenizer(directory: str | Path | None) -> ModelTokenizer | None:
    """The tokenizer in `directory`, or None (one log line) when it is missing or unusable:
    precise routing is then off and every endpoint uses the approximate index."""
    if not directory:
        log.warning("no tokenizer given (--tokenizer): precise prefix routing is off, the "
                    "approximate prefix index is used")
        return None
    try:
        tok = ModelTokenizer(directory)
    except TokenizerError as exc:
        log.warning("no usable tokenizer: precise prefix routing is off, the approximate "
                    "prefix index is used", extra={"error": str(exc)[:300]})
        return None
    log.info("tokenizer loaded", extra={"directory": str(directory),
                                        "chat_template": tok.template is not None})
    return tok
