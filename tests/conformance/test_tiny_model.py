"""The tiny model `make vllm` builds: deterministic, the shape vLLM's CPU backend accepts, sized
to the tokenizer beside it."""

from __future__ import annotations

import json
import subprocess

import pytest
from tokenizers import Tokenizer

from local import vllm_server
from local.tinymodel.model import HEAD_DIM, model_fingerprint


@pytest.fixture(scope="module")
def built():
    if not vllm_server.available():
        pytest.skip("the tiny model is built by make vllm")
    return vllm_server.MODEL_DIR


def test_the_model_is_rebuilt_byte_for_byte(built, tmp_path):
    subprocess.run([str(vllm_server.PYTHON), "-m", "local.tinymodel", "model", "--out", str(tmp_path)],
                   check=True, cwd=vllm_server.REPO, capture_output=True, timeout=300)
    assert model_fingerprint(tmp_path) == model_fingerprint(built)


def test_shape_fits_the_cpu_backend_and_the_tokenizer(built):
    config = json.loads((built / "config.json").read_text())
    tok = Tokenizer.from_file(str(built / "tokenizer.json"))
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == HEAD_DIM == 64
    assert config["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert config["eos_token_id"] == tok.token_to_id("<|im_end|>")


def test_the_lora_adapter_is_rebuilt_byte_for_byte_in_peft_layout(built, tmp_path):
    from local.tinymodel.lora import (CONFIG, DEFAULT_DIR, RANK, WEIGHTS, adapter_fingerprint,
                                      adapter_ready)
    if not adapter_ready(DEFAULT_DIR):
        pytest.skip("the adapter is built by make vllm")
    subprocess.run([str(vllm_server.PYTHON), "-m", "local.tinymodel", "lora", "--out", str(tmp_path),
                    "--model", str(built)], check=True, cwd=vllm_server.REPO, capture_output=True,
                   timeout=300)
    assert adapter_fingerprint(tmp_path) == adapter_fingerprint(DEFAULT_DIR)
    config = json.loads((tmp_path / CONFIG).read_text())
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", "CAUSAL_LM", RANK)
    model = json.loads((built / "config.json").read_text())
    shapes = safetensors_shapes(tmp_path / WEIGHTS)
    prefix = "base_model.model.model.layers.0.self_attn"
    assert shapes[f"{prefix}.q_proj.lora_A.weight"] == (RANK, model["hidden_size"])
    assert shapes[f"{prefix}.v_proj.lora_B.weight"] == (model["num_key_value_heads"] * model["head_dim"], RANK)
    assert len(shapes) == model["num_hidden_layers"] * len(config["target_modules"]) * 2


def safetensors_shapes(path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a .safetensors header (8-byte little-endian length, then JSON); read
    by hand because the project's virtualenv has no safetensors (the vLLM one has)."""
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
