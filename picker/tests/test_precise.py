"""Precise prefix routing in the Router: the model's tokenizer (the tiny model's, built by the
project), the engines' events in process, the per-endpoint fallback and the tokenizer check."""
from __future__ import annotations

import json
import logging
import random

import pytest

from helpers import FakeClock, metrics_text
from local.tinymodel.tokenizer import write_tokenizer
from picker.core import RequestInfo, Router
from picker.scheduling.precise import LOADED, MISMATCH, MISSING
from picker.scheduling.profile import load_profile
from picker.signals.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from picker.tokenizer import ModelTokenizer, NotTokenizable, load_tokenizer

A, B, C = "127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103"
BS = 16


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return ModelTokenizer(tok_dir)


def test_chat_template_as_vllm_applies_it(tok):
    body = {"model": "qwq", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]}
    ids = tok.request_tokens("/v1/chat/completions", body)
    text = tok.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello\nthere"
                    "<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tok.request_tokens("/v1/chat/completions", {**body, "add_generation_prompt": False})
    assert ids[:len(no_gen)] == no_gen and len(ids) > len(no_gen)
    assert tok.request_tokens("/v1/completions", {"prompt": "hello there"}) == \
        tok.tokenizer.encode("hello there").ids
    assert tok.request_tokens("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.request_tokens("/v1/completions", {"prompt": ["hello", "x"]}) == \
        tok.tokenizer.encode("hello").ids
    with pytest.raises(NotTokenizable):
        tok.request_tokens("/v1/chat/completions", {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})


def test_missing_or_broken_tokenizer_gives_none_and_one_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "picker.tokenizer"):
        assert load_tokenizer(tmp_path / "absent") is None
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
        assert load_tokenizer(tmp_path / "bad") is None
        assert load_tokenizer(None) is None
    assert len(caplog.records) == 3
    assert all("approximate" in r.getMessage() for r in caplog.records)


def build(tok=None, clock=None, endpoints=(A, B)) -> Router:
    clock = clock or FakeClock()
    r = Router(load_profile("default"), clock=clock, rng=random.Random(0))
    r.set_endpoints(list(endpoints))
    if tok is not False:
        r.enable_precise(tok)
    for e in endpoints:
        r.on_scrape_ok(e, metrics_text(block_size=BS, num_blocks=4000, kv=0.6))
    return r


def chat(system: str, user: str) -> bytes:
    return json.dumps({"model": "qwq", "max_tokens": 8, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()


def decide(r: Router, body: bytes):
    return r.decide(RequestInfo("/v1/chat/completions", {}, body))


def store_events(tokens: list[int], rng: random.Random) -> list:
    """What an engine with BS-token blocks publishes when it prefills these tokens."""
    n = len(tokens) // BS
    hashes = [rng.getrandbits(64) for _ in range(n)]
    return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:n * BS],
                        block_size=BS, medium="GPU")], hashes


SYSTEM = " ".join(f"baba{i % 10} babe" for i in range(300))


def test_precise_follows_the_engines_where_the_approximate_index_is_wrong(tok):
    """The picker sent the tenant to one endpoint, which evicted it; another replica's traffic
    made another endpoint cache it. The events say so; the approximate index cannot know."""
    rng = random.Random(1)
    r = build(tok)
    for e in (A, B):
        r.on_kv_events(e, [])                         # both publish, in sync from the start
    first = decide(r, chat(SYSTEM, "question one"))
    other = B if first.endpoint == A else A
    tokens = tok.request_tokens("/v1/chat/completions", json.loads(chat(SYSTEM, "question one")))
    events, hashes = store_events(tokens, rng)
    r.on_kv_events(first.endpoint, events)
    r.on_kv_events(first.endpoint, [BlockRemoved(block_hashes=hashes, medium="GPU")])
    r.on_kv_events(other, store_events(tokens, rng)[0])
    second = decide(r, chat(SYSTEM, "question two"))
    assert second.endpoint == other
    assert second.cached_tokens >= len(tokens) // BS * BS - 3 * BS  # the system prompt's blocks
    assert second.prompt_tokens == len(tok.request_tokens(
        "/v1/chat/completions", json.loads(chat(SYSTEM, "question two"))))

    plain = build(False)                              # the approximate index alone
    d1 = decide(plain, chat(SYSTEM, "question one"))
    assert decide(plain, chat(SYSTEM, "question two")).endpoint == d1.endpoint


def test_fallback_is_per_endpoint(tok):
    """A is in sync and holds nothing of the prompt; B has no events: its share comes from the
    approximate index (which believes B holds the prompt the picker sent there)."""
    r = build(tok)
    r.on_kv_events(A, [])
    body = chat(SYSTEM, "q")
    r.prefix.add(B, __import__("picker.scheduling.prefix", fromlist=["x"]).block_hashes(
        "qwq", "system:" + SYSTEM + "\nuser:q\n", 64, 256))
    d = decide(r, body)
    assert d.endpoint == B and d.cached_tokens > 0
    assert r.precise.index.in_sync(A) and not r.precise.index.in_sync(B)


def test_cleared_engine_starts_empty(tok):
    rng = random.Random(2)
    r = build(tok)
    tokens = tok.request_tokens("/v1/chat/completions", json.loads(chat(SYSTEM, "q")))
    r.on_kv_events(A, store_events(tokens, rng)[0])
    r.on_kv_events(B, [])
    assert decide(r, chat(SYSTEM, "q")).endpoint == A
    r.on_kv_events(A, [AllBlocksCleared()])
    r.on_kv_events(B, store_events(tokens, rng)[0])
    assert decide(r, chat(SYSTEM, "q")).endpoint == B
    assert r.precise.index.size(A) == 0


def test_missing_tokenizer_routes_on_the_approximate_index():
    r = build(None)
    assert r.precise.state == MISSING
    d1 = decide(r, chat(SYSTEM, "a"))
    assert decide(r, chat(SYSTEM, "b")).endpoint == d1.endpoint
    assert d1.prompt_tokens == -(-len("system:" + SYSTEM + "\nuser:a\n") // 4)


def test_mismatching_tokenizer_is_detected_and_precise_turns_off(tok, caplog):
    """The engines tokenize differently (another model): the first blocks of the requests the
    picker routes never show up in their events."""
    clock = FakeClock()
    r = build(tok, clock)
    rng = random.Random(3)
    for e in (A, B):
        r.on_kv_events(e, [])
    assert r.precise.state == LOADED
    with caplog.at_level(logging.ERROR, "picker.precise"):
        for i in range(60):
            for e in (A, B):
                r.on_scrape_ok(e, metrics_text(block_size=BS, num_blocks=4000, kv=0.6))
            body = chat(f"tenant {i} " + SYSTEM, "q")
            d = decide(r, body)
            tokens = tok.request_tokens("/v1/chat/completions", json.loads(body))
            other_model = [t + 1 for t in tokens]     # what another tokenizer would give
            r.on_kv_events(d.endpoint, store_events(other_model, rng)[0])
            clock.t += 10.0
    assert r.precise.state == MISMATCH
    assert len(caplog.records) == 1 and "tokenizer does not match" in caplog.records[0].getMessage()
    d = decide(r, chat(SYSTEM, "q"))
    assert d.prompt_tokens == -(-len("system:" + SYSTEM + "\nuser:q\n") // 4)  # approximate again


def test_matching_tokenizer_passes_the_check(tok):
    clock = FakeClock()
    r = build(tok, clock)
    rng = random.Random(4)
    for e in (A, B):
        r.on_kv_events(e, [])
    for i in range(60):
        for e in (A, B):
            r.on_scrape_ok(e, metrics_text(block_size=BS, num_blocks=4000, kv=0.6))
        body = chat(f"tenant {i} " + SYSTEM, "q")
        d = decide(r, body)
        tokens = tok.request_tokens("/v1/chat/completions", json.loads(body))
        r.on_kv_events(d.endpoint, store_events(tokens, rng)[0])
        clock.t += 10.0
    assert r.precise.state == LOADED and r.precise._misses == 0


def test_untokenizable_request_uses_the_approximate_index(tok):
    r = build(tok)
    for e in (A, B):
        r.on_kv_events(e, [])
    body = json.dumps({"model": "qwq", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}).encode()
    d = decide(r, body)
    assert d.endpoint in (A, B) and r.precise.untokenizable == 1


def test_windowed_tokenization_equals_the_whole(tok):
    """Long prompts are tokenized in windows cut where a pre-token starts (cached per shared
    prefix); joined they must be exactly the whole text's tokens."""
    assert tok.windowed
    rng = random.Random(7)
    words = ["baba", "babe", "x1234", "naïve", "東京", "don't", "a-b", "\n\n", "  ", "<|im_end|>",
             "?!", "3.14", "\t"]
    for _ in range(5):
        text = "".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(3000))
        for special in (True, False):
            joined = [t for ids, _ in tok.windows(text, special) for t in ids]
            assert joined == tok.encode_text(text, special)
            again = [t for ids, _ in tok.windows(text, special) for t in ids]  # from the cache
            assert again == joined


def test_tokenizing_stops_where_no_engine_holds_the_prompt(tok):
    """A tenant's long system prompt cached on A, then a long unique question: the cached part
    is counted exactly, the rest estimated (tokenizing it could not change the match)."""
    rng = random.Random(8)
    r = build(tok)
    r.on_kv_events(B, [])
    system = " ".join(f"baba{i % 10}" for i in range(2000))
    body = json.loads(chat(system, "q"))
    tokens = tok.request_tokens("/v1/chat/completions", body)
    r.on_kv_events(A, store_events(tokens, rng)[0])
    question = " ".join(f"babe{i % 7} zz{i % 1000}" for i in range(3000))
    long_body = chat(system, question)
    whole = len(tok.request_tokens("/v1/chat/completions", json.loads(long_body)))
    prep = r.precise.prepare("/v1/chat/completions",
                             __import__("picker.openai", fromlist=["x"]).parse_body(long_body), None)
    assert prep.cached[A] >= (len(tokens) // BS - 2) * BS
    assert B not in prep.cached
    approx = -(-len("system:" + system + "\nuser:" + question + "\n") // 4)  # without a tokenizer
    assert abs(prep.prompt_tokens - whole) < 0.3 * whole
    assert abs(prep.prompt_tokens - whole) < abs(approx - whole)
    d = decide(r, long_body)
    assert d.endpoint == A and d.cached_tokens == prep.cached[A]


def test_context_mixes_precise_and_approximate_per_endpoint():
    from picker.scheduling.context import SchedulingContext
    from picker.scheduling.scorers import precise_prefix_scorer
    from picker.signals.state import EndpointState
    ctx = SchedulingContext("qwq", 1000, None, 0, 0.0, block_size_tokens=64)
    ctx.hashes = [1] * 10
    ctx.prefix_match = {"a": 5, "b": 8, "c": 2}       # approximate: blocks of 64 tokens
    ctx.precise = {"a": 160}                          # precise: tokens (a holds 160)
    ctx.sync = {"a": "", "b": "", "c": "syncing"}     # a and b in sync, c falls back
    assert [ctx.cached_tokens(x) for x in "abc"] == [160, 0, 128]
    assert ctx.owner_tokens() == {"a": 160, "c": 128}
    eps = [EndpointState(x) for x in "abc"]
    assert precise_prefix_scorer()(ctx, eps) == [0.16, 0.0, 0.2]


def test_lora_adapter_blocks_match_only_requests_for_that_adapter(tok):
    rng = random.Random(9)
    r = Router(load_profile("default"), clock=FakeClock(), rng=random.Random(0))
    r.set_endpoints([A, B])
    r.enable_precise(tok)
    for e in (A, B):
        r.on_scrape_ok(e, metrics_text(block_size=BS, num_blocks=4000, kv=0.6,
                                       lora={"max": 2, "running": ["adapter"]}))
        r.on_kv_events(e, [])
    body = json.loads(chat(SYSTEM, "q"))
    tokens = tok.request_tokens("/v1/chat/completions", body)
    n = len(tokens) // BS
    r.on_kv_events(A, [BlockStored(block_hashes=[rng.getrandbits(64) for _ in range(n)],
                                   parent_block_hash=None, token_ids=tokens[:n * BS],
                                   block_size=BS, lora_name="adapter")])
    from picker.openai import parse_body
    for_adapter = parse_body(json.dumps({**body, "model": "adapter"}).encode())
    for_base = parse_body(json.dumps(body).encode())
    assert r.precise.prepare("/v1/chat/completions", for_adapter, "adapter").cached == {A: n * BS}
    assert r.precise.prepare("/v1/chat/completions", for_base, None).cached == {}
    d = r.decide(RequestInfo("/v1/chat/completions", {}, json.dumps({**body, "model": "adapter"}).encode()))
    assert d.endpoint == A and d.cached_tokens == min(n * BS, d.prompt_tokens)


def test_precise_changes_only_what_is_believed_cached(tok):
    """Endpoints in sync that hold none of the prompts: the precise picker decides as the
    approximate one and counts the same prompt tokens in its load terms (the profile's units),
    though its tokenizer counts the prompts differently."""
    def routers():
        out = []
        for t in (False, tok):
            r = build(t, endpoints=(A, B, C))
            for e, (waiting, kv) in zip((A, B, C), ((1, 0.7), (0, 0.5), (3, 0.2))):
                r.on_scrape_ok(e, metrics_text(waiting=waiting, running=4, kv=kv,
                                               block_size=BS, num_blocks=400))
                if t:
                    r.on_kv_events(e, [])
            out.append(r)
        return out
    plain, precise = routers()
    rng = random.Random(3)
    counted_apart = 0
    for i in range(24):
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randrange(20, 900)))
        body = chat(f"tenant {i} " + words, f"question {i}")
        a, b = decide(plain, body), decide(precise, body)
        assert a.endpoint == b.endpoint
        counted_apart += a.prompt_tokens != b.prompt_tokens   # reported: the tokenizer's count
        for e in (A, B, C):
            assert plain.endpoints[e].since_scrape_tokens == precise.endpoints[e].since_scrape_tokens
    assert counted_apart == 24
    assert plain.avg_prompt_tokens == precise.avg_prompt_tokens


def test_precise_cached_share_is_scaled_to_the_prompt_estimate(tok):
    """The engines' cached tokens become the same share of the picker's own prompt estimate, in
    whole blocks of the approximate index (64 tokens)."""
    from picker.scheduling.context import SchedulingContext
    from picker.scheduling.precise import Prepared
    r = build(tok)
    r.on_kv_events(A, [])
    ctx = SchedulingContext("qwq", 1250, None, 0, 0.0, block_size_tokens=64)
    r.precise.apply_to(ctx, Prepared(prompt_tokens=1000, cached={A: 800, B: 40}, first={}))
    assert ctx.precise == {A: 960, B: 0}          # 1,000 and 50 estimated tokens, in whole blocks
    assert ctx.cached_tokens(A) == 960 and ctx.cached_tokens(B) == 0
