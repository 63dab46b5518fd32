"""In-flight (speculative) entries of precise prefix routing: a request routed to an endpoint
in sync counts as held there until its engine's events confirm it or the entry expires, so a
burst of one tenant is not spread before the first prefill's events arrive."""
from __future__ import annotations

import json
import random

import pytest

from helpers import FakeClock
from local.tinymodel.tokenizer import write_tokenizer
from picker import defaults
from picker.openai import parse_body
from picker.scheduling.kvindex import PreciseIndex
from picker.signals.kvevents import BlockRemoved
from picker.tokenizer import ModelTokenizer
from test_precise import BS, SYSTEM, build, chat, decide, store_events

A, B, C = "127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103"
PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return ModelTokenizer(write_tokenizer(tmp_path_factory.mktemp("tiny-model")))


def in_sync_router(tok, clock, ttl=defaults.KV_INFLIGHT_TTL):
    r = build(tok, clock, endpoints=(A, B, C))
    r.precise.inflight_ttl = ttl
    for e in (A, B, C):
        r.on_kv_events(e, [])                 # all publish, nothing cached yet
    return r


def burst(r, clock, n=8, tenant=SYSTEM):
    out = []
    for i in range(n):
        out.append(decide(r, chat(tenant, f"question number {i} about topic {i * 7}")))
        clock.t += 0.05                      # no event arrives in between
    return out


def test_a_burst_of_one_tenant_goes_to_one_endpoint_before_any_event(tok):
    clock = FakeClock()
    r = in_sync_router(tok, clock)
    ds = burst(r, clock)
    assert len({d.endpoint for d in ds}) == 1
    assert all(d.cached_tokens >= 50 * BS for d in ds[1:])   # the system prompt's blocks
    # without in-flight entries the same burst spreads (nothing matches before the events)
    clock2 = FakeClock()
    spread = burst(in_sync_router(tok, clock2, ttl=0), clock2)
    assert len({d.endpoint for d in spread}) > 1
    assert all(d.cached_tokens == 0 for d in spread)


def test_the_whole_chain_is_recorded_though_tokenization_stopped_early(tok):
    clock = FakeClock()
    r = in_sync_router(tok, clock)
    body = chat(SYSTEM, "first question")
    tokens = tok.request_tokens(PATH, json.loads(body))
    prep = r.precise.prepare(PATH, r_parsed(r, body), None, clock())
    assert len(prep.chains[BS]) < len(tokens) // BS // 2   # nothing held: stopped after a window
    d = decide(r, body)
    assert r.precise.index.inflight(d.endpoint) == len(tokens) // BS
    assert r.precise.index.size(d.endpoint) == 0        # confirmed blocks: none yet


def r_parsed(r, body):
    return parse_body(body)


def test_in_flight_entries_expire(tok):
    clock = FakeClock()
    r = in_sync_router(tok, clock, ttl=5.0)
    d = decide(r, chat(SYSTEM, "one"))
    assert r.precise.index.inflight(d.endpoint) > 0
    clock.t += 4.0
    again = r.precise.prepare(PATH, r_parsed(r, chat(SYSTEM, "two")), None, clock())
    assert again.cached.get(d.endpoint, 0) >= 50 * BS
    clock.t += 1.5                            # past the TTL: a shed request stops counting
    later = r.precise.prepare(PATH, r_parsed(r, chat(SYSTEM, "three")), None, clock())
    assert later.cached == {}
    assert r.precise.index.inflight() == 0


def test_events_confirm_in_flight_entries(tok):
    clock = FakeClock()
    r = in_sync_router(tok, clock, ttl=5.0)
    rng = random.Random(7)
    body = chat(SYSTEM, "one")
    d = decide(r, body)
    tokens = tok.request_tokens(PATH, json.loads(body))
    events, hashes = store_events(tokens, rng)
    r.on_kv_events(d.endpoint, events)
    index = r.precise.index
    assert index.inflight(d.endpoint) == 0 and index.size(d.endpoint) == len(tokens) // BS
    clock.t += 60.0                           # long past the TTL: the engine's word holds
    prep = r.precise.prepare(PATH, r_parsed(r, chat(SYSTEM, "two")), None, clock())
    assert prep.cached.get(d.endpoint, 0) >= 50 * BS
    # confirmed, then evicted within what was the TTL: no longer held
    d2 = decide(r, chat(SYSTEM + " other tenant", "x"))
    t2 = tok.request_tokens(PATH, json.loads(chat(SYSTEM + " other tenant", "x")))
    ev2, h2 = store_events(t2, rng)
    r.on_kv_events(d2.endpoint, ev2)
    r.on_kv_events(d2.endpoint, [BlockRemoved(block_hashes=h2, medium="GPU")])
    assert index.inflight(d2.endpoint) == 0 and not index.holds(h2[0], d2.endpoint)


def test_the_tokenizer_check_ignores_in_flight_entries(tok):
    """An in-flight first block is not proof the engine stored it: the check still needs events."""
    clock = FakeClock()
    r = in_sync_router(tok, clock)
    d = decide(r, chat(SYSTEM, "one"))
    h = r.precise._checks[-1][2]
    assert r.precise.index.holds_any(h) and not r.precise.index.holds(h, d.endpoint)


def test_leaving_sync_drops_an_endpoints_in_flight_entries():
    index = PreciseIndex()
    index.apply([(A, True, "", BS, [], []), (B, True, "", BS, [], [])])
    index.add_inflight(A, [1, 2, 3], 10.0)
    index.add_inflight(B, [1, 2], 10.0)
    assert index.match([1, 2, 3]) == {A: 3, B: 2}
    index.apply([(A, False, "gap", BS, [], [])])
    assert index.match([1, 2, 3]) == {B: 2} and index.inflight(A) == 0
    index.add_inflight(A, [9], 10.0)          # not in sync: not recorded
    assert not index.holds_any(9)


def test_in_flight_entries_are_capped_oldest_first():
    index = PreciseIndex()
    index.inflight_max = 10
    index.apply([(A, True, "", BS, [], [])])
    for i in range(5):
        index.add_inflight(A, [100 * i + k for k in range(4)], 10.0 + i)
    assert index.inflight() <= 10
    assert index.match([400, 401, 402, 403]) == {A: 4}      # the newest kept
    assert index.match([0, 1]) == {}                          # the oldest dropped
    index.expire(13.0)
    assert index.inflight() == 4
