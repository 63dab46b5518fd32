"""A tiny model the project builds itself, offline and deterministically: its tokenizer
(`tokenizer.py`, the `tokenizers` library) and, with torch + transformers, its random weights.
The simulator, the picker and a real vLLM all read the same files from one directory."""

from pathlib import Path

# Where the local stack and the tests keep the built model (gitignored, under the repo's .cache).
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "tiny-model"
