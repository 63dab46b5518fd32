"""The lab's prompt token ids are exactly the tiny model's tokenizer's, on every workload."""

import pytest

from lab.tokenizer import lab_tokenizer, prompt_token_ids
from loadtest.workloads import build_workload


@pytest.mark.parametrize("workload", ["article", "shared-prefix", "chat-reasoning", "multi-turn",
                                      "long-tail", "demo"])
def test_word_lookup_equals_the_tokenizer(workload):
    prompts = [s.prompt for s in build_workload(workload, seed=5, num_prompts=12)]
    tok = lab_tokenizer().tokenizer
    assert prompt_token_ids(prompts) == [tok.encode(p).ids for p in prompts]


def test_other_text_goes_through_the_tokenizer():
    prompts = ["Hello,  world!\nHow's it going?", "tab\tseparated", "x", "don't stop me now"]
    tok = lab_tokenizer().tokenizer
    assert prompt_token_ids(prompts) == [tok.encode(p).ids for p in prompts]
