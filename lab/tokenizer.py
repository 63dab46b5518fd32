"""The lab's tokenizer: the tiny model's (local/tinymodel), the one the local stack's simulators
and picker use, so that the engines' KV-cache events and the picker's own tokenization agree in
the lab as they do on the stack. Every load-test word is one token in it, so token counts (and
so every engine's schedule) are those of the simulator's word convention.

Built on first use into local.tinymodel.DEFAULT_DIR (deterministic, under a second); written to a
temporary directory first and moved into place, so parallel lab workers never read half a file.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from local.sim.tokenizer import ModelTokenizer
from local.tinymodel import DEFAULT_DIR

FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(directory: Path = DEFAULT_DIR) -> Path:
    if all((directory / f).is_file() for f in FILES):
        return directory
    from local.tinymodel.tokenizer import write_tokenizer
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        write_tokenizer(Path(tmp))
        for f in FILES:
            os.replace(Path(tmp) / f, directory / f)
    return directory


@functools.lru_cache(maxsize=1)
def lab_tokenizer() -> ModelTokenizer:
    return ModelTokenizer(tokenizer_dir())


def prompt_token_ids(prompts: list[str]) -> list[list[int]]:
    """Completions' token ids as the engine (and the picker) compute them."""
    tok = lab_tokenizer().tokenizer
    return [e.ids for e in tok.encode_batch(prompts, add_special_tokens=True)]
