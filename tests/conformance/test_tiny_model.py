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
