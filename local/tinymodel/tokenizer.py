"""The tiny model's tokenizer: a byte-level BPE trained here with the `tokenizers` library.

Deterministic and offline: the training corpus is generated from the load tests' own word
vocabulary (loadtest/workloads.py) and the simulator's output words, so every workload word is
exactly one token, with or without a leading space. The load tests' convention "one word = one
token" then holds for the simulator, the picker and a real vLLM serving the tiny model alike.
Any other text still tokenizes (byte-level fallback, like Qwen2's tokenizer).

Files written (what vLLM and the picker read from a model directory):
  tokenizer.json          the `tokenizers` model
  tokenizer_config.json   special tokens and the ChatML chat template (Qwen2's framing)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import loadtest.prompts as prompts_module
import local.sim.tokens as sim_tokens_module
from loadtest.prompts import VOCABULARY
from local.sim.tokens import FILLER

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML as Qwen2 frames it, without Qwen2's default system message (the simulator's chat token
# count follows the same framing: local/sim/tokens.py chat_token_ids).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer, Qwen2's tokenizer.json).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Room for every workload word twice (with and without the leading-space marker) plus the merges
# that build them, the filler words and the 256 byte symbols.
VOCAB_SIZE = 16384
# A little ordinary text so that words outside the workloads split into sensible pieces.
_GENERAL_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? "
    "Explain step by step how a transformer model predicts the next token. "
    "question answer reasoning think because therefore "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 , . ; : ! ? ( ) [ ] { } \" ' - _ / \\ \n"
)


def _corpus() -> list[str]:
    """Training lines: each word with and without a leading space, equally often, in a fixed
    order (the trainer then sees the same counts on every machine)."""
    words = [str(w) for w in VOCABULARY] + list(FILLER) + ["user", "system", "assistant"]
    lines = []
    for _ in range(4):
        lines.append(" " + " ".join(words))
        lines.extend(words)
    lines.extend([_GENERAL_TEXT] * 8)
    return lines


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Qwen2's own pipeline (NFC, its split regex, byte-level without the GPT-2 regex): vLLM's
    # transformers builds a Qwen2 model's tokenizer from code with exactly these and ignores the
    # file's, so the file must say the same for the picker and the simulator (which read the
    # file) to get vLLM's token ids (digits one by one, for instance).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out: Path) -> Path:
    """Train and write tokenizer.json + tokenizer_config.json into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    train().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / BUILDER_STAMP).write_text(builder_digest())
    return out


def fingerprint(directory: Path) -> str:
    """SHA-256 over the tokenizer files: equal on every machine for the same code."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        h.update((directory / name).read_bytes())
    return h.hexdigest()


# What the trained files depend on: this module and the word lists it trains on. A cached
# tokenizer whose recorded builder digest differs was made by other code and is trained again.
BUILDER_SOURCES = (Path(__file__), Path(prompts_module.__file__), Path(sim_tokens_module.__file__))
BUILDER_STAMP = ".tokenizer-builder"
FILES = ("tokenizer.json", "tokenizer_config.json")


def builder_digest() -> str:
    h = hashlib.sha256()
    for path in BUILDER_SOURCES:
        h.update(path.read_bytes())
    return h.hexdigest()


def ensure_tokenizer(directory: Path) -> Path:
    """The tokenizer in `directory`, trained there first if it is missing or was built by other
    code. Written to a temporary directory and moved into place, so parallel users (lab workers,
    the stack) never read half a file."""
    digest = builder_digest()
    stamp = directory / BUILDER_STAMP
    if all((directory / f).is_file() for f in FILES) and stamp.is_file() and stamp.read_text() == digest:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        write_tokenizer(Path(tmp))
        for f in (*FILES, BUILDER_STAMP):      # the stamp last: it vouches for the files
            os.replace(Path(tmp) / f, directory / f)
    return directory
