"""Cold prefixes by rendezvous hashing (scheduling/rendezvous.py): independent picker replicas
that share nothing send a new prefix to the same endpoint; warm prefixes go where they are
cached; the agreed endpoint is skipped when it scores too far below the best."""
from __future__ import annotations

import json
import random

import pytest

from helpers import FakeClock, metrics_text
from local.tinymodel.tokenizer import write_tokenizer
from picker.core import RequestInfo, Router
from picker.scheduling.profile import load_profile, profile_from_dict
from picker.scheduling.rendezvous import ColdPrefixSettings, prefix_key, weight
from picker.tokenizer import ModelTokenizer
from test_precise import BS, store_events

ENDPOINTS = [f"127.0.0.1:{8101 + i}" for i in range(6)]
PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return ModelTokenizer(write_tokenizer(tmp_path_factory.mktemp("tiny-model")))


def router(seed: int, cold: ColdPrefixSettings | None = None, tok=None,
           endpoints=ENDPOINTS) -> Router:
    profile = load_profile("default")
    if cold is not None:
        profile.cold_prefix = cold
    r = Router(profile, clock=FakeClock(), rng=random.Random(seed))
    r.set_endpoints(list(endpoints))
    if tok is not None:
        r.enable_precise(tok)
    for e in endpoints:
        r.on_scrape_ok(e, metrics_text(block_size=BS, num_blocks=4000, kv=0.1))
        if tok is not None:
            r.on_kv_events(e, [])             # in sync, nothing cached
    return r


def tenant(i: int) -> str:
    return " ".join(f"tenant{i} word{j % 13}" for j in range(400))


def chat(system: str, user: str) -> bytes:
    return json.dumps({"model": "qwq", "max_tokens": 8, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()


def first_endpoint(r: Router, i: int) -> str:
    return r.decide(RequestInfo(PATH, {}, chat(tenant(i), f"question {i}"))).endpoint


def test_the_default_profile_places_cold_prefixes_by_rendezvous():
    assert load_profile("default").cold_prefix.enabled


@pytest.mark.parametrize("precise", [False, True])
def test_independent_replicas_send_a_new_tenant_to_the_same_endpoint(precise, tok):
    """Each replica sees only its own decisions: tenant i is new to both, and both choose the
    same endpoint for it; the tenants still spread over the pool."""
    tokenizer = tok if precise else None
    one, two = router(1, tok=tokenizer), router(2, tok=tokenizer)
    firsts = [first_endpoint(one, i) for i in range(12)]
    assert firsts == [first_endpoint(two, i) for i in range(12)]
    assert len(set(firsts)) >= 3
    # without the rule the tie between idle endpoints is broken at random, per replica
    off = ColdPrefixSettings(tolerance=-1.0)
    a, b = router(1, off, tokenizer), router(2, off, tokenizer)
    assert [first_endpoint(a, i) for i in range(12)] != [first_endpoint(b, i) for i in range(12)]


def test_a_warm_prefix_still_goes_where_it_is_cached(tok):
    """The engine of an endpoint other than the agreed one reports holding the tenant's
    system prompt: the request goes there."""
    r = router(1, tok=tok)
    agreed = first_endpoint(router(3, tok=tok), 0)
    holder = next(e for e in ENDPOINTS if e != agreed)
    body = chat(tenant(0), "another question")
    tokens = tok.request_tokens(PATH, json.loads(body))
    events, _ = store_events(tokens[:len(tokens) // 2], random.Random(4))
    r.on_kv_events(holder, events)
    d = r.decide(RequestInfo(PATH, {}, body))
    assert d.endpoint == holder and d.cached_tokens > 0


def test_the_agreed_endpoint_is_skipped_when_far_more_loaded():
    """A long queue on the agreed endpoint puts it out of tolerance: the best one wins."""
    agreed = first_endpoint(router(1), 0)
    r = router(1)
    r.on_scrape_ok(agreed, metrics_text(waiting=20, running=8, block_size=BS, num_blocks=4000,
                                        kv=0.5))
    assert first_endpoint(r, 0) != agreed


def test_the_tolerance_lets_the_agreed_endpoint_win_though_a_little_busier():
    agreed = first_endpoint(router(1), 0)
    busier = metrics_text(waiting=1, running=1, block_size=BS, num_blocks=4000, kv=0.15)
    for tolerance, wins in ((0.0, False), (7.0, True)):
        r = router(1, ColdPrefixSettings(tolerance, 4))
        r.on_scrape_ok(agreed, busier)
        assert (first_endpoint(r, 0) == agreed) is wins


def test_weights_are_stable_and_the_key_names_the_leading_blocks():
    assert weight(7, "10.0.0.1:8000") == weight(7, "10.0.0.1:8000")
    assert weight(7, "10.0.0.1:8000") != weight(8, "10.0.0.1:8000")
    assert prefix_key([], 4) is None
    assert prefix_key([11, 12], 4) is None
    assert prefix_key([11, 12, 13, 14], 4) == 14
    assert prefix_key([11, 12, 13, 14, 15], 4) == 14


def test_profile_settings_are_checked():
    doc = {"scorers": ["queue"], "coldPrefix": {"tolerance": 1.5, "keyBlocks": 8}}
    p = profile_from_dict(doc)
    assert p.cold_prefix == ColdPrefixSettings(1.5, 8)
    assert not profile_from_dict({"scorers": ["queue"]}).cold_prefix.enabled
    for bad in ({"tolerance": -1}, {"keyBlocks": 0}, {"other": 1}, [1]):
        with pytest.raises(ValueError, match="coldPrefix"):
            profile_from_dict({"scorers": ["queue"], "coldPrefix": bad})
