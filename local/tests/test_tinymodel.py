"""The tiny model's tokenizer: deterministic, and every load-test word is one token."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import Tokenizer

from loadtest.prompts import VOCABULARY
from local.sim.tokens import FILLER
from local.tinymodel.tokenizer import EOS_TOKEN, fingerprint, write_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = write_tokenizer(tmp_path_factory.mktemp("tok"))
    return out, Tokenizer.from_file(str(out / "tokenizer.json"))


def test_training_is_deterministic(built, tmp_path):
    out, _ = built
    assert fingerprint(write_tokenizer(tmp_path)) == fingerprint(out)


def test_every_workload_word_is_one_token_with_or_without_a_space(built):
    _, tok = built
    words = [str(w) for w in VOCABULARY] + list(FILLER)
    several = [w for w in words if len(tok.encode(w).ids) != 1 or len(tok.encode(" " + w).ids) != 1]
    assert several == []
    prompt = " ".join(words[:500])
    assert len(tok.encode(prompt).ids) == 500
    assert tok.decode(tok.encode(prompt).ids) == prompt


def test_other_text_falls_back_to_bytes_and_round_trips(built):
    _, tok = built
    text = "Grüße, 世界! w1234 {\"a\": [1, 2]}"
    assert tok.decode(tok.encode(text).ids) == text


def test_chat_template_is_chatml_and_special_tokens_are_single_ids(built):
    out, tok = built
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN
    rendered = jinja2.Environment().from_string(config["chat_template"]).render(
        messages=[{"role": "system", "content": "bada"}, {"role": "user", "content": "zuto kime"}],
        add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nbada<|im_end|>\n<|im_start|>user\nzuto kime<|im_end|>\n"
                        "<|im_start|>assistant\n")
    tokens = tok.encode(rendered).tokens
    assert tokens[:3] == ["<|im_start|>", "system", "Ċ"]
    assert tokens.count("<|im_end|>") == 2 and tokens[-3:] == ["<|im_start|>", "assistant", "Ċ"]


def test_the_file_carries_qwen2s_own_pipeline(built):
    """vLLM's transformers builds a Qwen2 tokenizer from code (NFC, Qwen2's split regex, byte
    level without the GPT-2 regex) and ignores the file's pipeline; the picker and the simulator
    read the file. Checked against a real vLLM 0.32 serving the tiny model: the same token ids
    and KV blocks for chat and completion prompts with digits, once the file says the same."""
    out, tok = built
    spec = json.loads((out / "tokenizer.json").read_text())
    assert spec["normalizer"]["type"] == "NFC"
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated"
    assert split["pattern"]["Regex"] == (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
        r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert tok.encode("w2600").tokens == ["w", "2", "6", "0", "0"]  # digits one by one
    assert tok.encode("e\u0301").ids == tok.encode("\u00e9").ids   # NFC


def test_a_cached_tokenizer_from_other_builder_code_is_trained_again(tmp_path, monkeypatch):
    from local.tinymodel import tokenizer as builder
    ensure = builder.ensure_tokenizer
    ensure(tmp_path)
    first = fingerprint(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")          # stale file, same builder stamp
    assert ensure(tmp_path) and (tmp_path / "tokenizer.json").read_text() == "{}"  # trusted as is
    monkeypatch.setattr(builder, "builder_digest", lambda: "other code")
    ensure(tmp_path)
    assert fingerprint(tmp_path) == first
    assert (tmp_path / builder.BUILDER_STAMP).read_text() == "other code"
