"""The tiny model's weights: a random-weight Qwen2 that real vLLM serves on a CPU.

Needs torch + transformers, so it runs with the vLLM virtualenv's python (`make vllm`), not the
project's. Deterministic: the weights come from a fixed seed on the CPU generator, and the files
are written in a fixed order, so the same code writes the same bytes on every machine.

The shape is the smallest that vLLM's CPU attention kernels accept: head dimension 64 (16 crashes
the engine at its first request), 2 layers, hidden size 256, 4 query heads over 2 KV heads
(grouped-query attention, as Qwen2 and QwQ-32B use). Files written into the model directory
(beside the tokenizer's): config.json, generation_config.json, model.safetensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from local.tinymodel.tokenizer import EOS_TOKEN, PAD_TOKEN, write_tokenizer

SEED = 0
LAYERS = 2
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS          # 64: the CPU attention backend's smallest supported size
INTERMEDIATE = 512
MAX_POSITIONS = 32768               # the context the rotary embedding is defined for
WEIGHTS = "model.safetensors"


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """Qwen2's config.json fields for the tiny shape (float32: the CPU backend's native type)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }


def _special_ids(tokenizer_dir: Path) -> tuple[int, int, int]:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    if eos is None or pad is None:
        raise ValueError(f"{tokenizer_dir / 'tokenizer.json'}: no id for {EOS_TOKEN} or {PAD_TOKEN}")
    return tok.get_vocab_size(with_added_tokens=True), eos, pad


def write_model(out: Path) -> Path:
    """Write the tokenizer, config.json, generation_config.json and the weights into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    write_tokenizer(out)          # always: the weights must match this tokenizer's vocabulary
    vocab_size, eos, pad = _special_ids(out)
    config = model_config(vocab_size, eos, pad)
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    # Tied embeddings: store the shared matrix once, under the embedding's name (as Qwen2's
    # small checkpoints do); sorted names keep the file's layout fixed.
    state = {k: v.detach().contiguous() for k, v in sorted(model.state_dict().items())
             if k != "lm_head.weight"}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return out


def model_fingerprint(directory: Path) -> str:
    """SHA-256 over the files this module writes: equal on every machine for the same code."""
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json", WEIGHTS):
        h.update((directory / name).read_bytes())
    return h.hexdigest()


def model_ready(directory: Path) -> bool:
    return all((directory / f).is_file() for f in
               ("config.json", "generation_config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json"))
