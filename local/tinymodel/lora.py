"""A LoRA adapter for the tiny model, written in peft's file layout without peft: what vLLM's
`--lora-modules NAME=DIR` loads (adapter_config.json + adapter_model.safetensors).

Needs torch + safetensors (the vLLM virtualenv's python, like model.py). Deterministic: seeded
weights on the CPU generator, keys written in sorted order. The adapter changes the attention's
query and value projections of every layer (rank 8, vLLM's --max-lora-rank the tests start with).
peft itself is not needed to write two JSON fields and a handful of tensors; these are the keys
and shapes peft writes for Qwen2 (lora_A [rank, in], lora_B [out, rank]).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from local.tinymodel import DEFAULT_DIR as MODEL_DIR
from local.tinymodel.model import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS

# Beside the model's directory (vLLM loads an adapter from its own directory).
DEFAULT_DIR = MODEL_DIR.parent / "tiny-model-lora"

SEED = 1
RANK = 8
ALPHA = 16
TARGETS = {"q_proj": HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM}   # module -> output size
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def adapter_config(base_model: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_adapter(out: Path, base_model: Path) -> Path:
    """Write the adapter for the tiny model in `base_model` into `out`."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(SEED)
    state = {}
    for layer in range(LAYERS):
        for module, out_size in sorted(TARGETS.items()):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # non-zero B (peft initialises it to zero): a trained adapter changes the output
            state[f"{key}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator) * 0.02
            state[f"{key}.lora_B.weight"] = torch.randn(out_size, RANK, generator=generator) * 0.02
    save_file(dict(sorted(state.items())), str(out / WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(base_model.name)   # a name, not a machine path: same bytes anywhere
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def adapter_fingerprint(directory: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        h.update((directory / name).read_bytes())
    return h.hexdigest()


def adapter_ready(directory: Path) -> bool:
    return all((directory / f).is_file() for f in (CONFIG, WEIGHTS))
