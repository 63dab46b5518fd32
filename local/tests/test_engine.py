"""Engine model: admission, chunked prefill, preemption, prefix cache, step times (injected clock)."""

import pytest

from local.sim.engine import Engine, block_hashes
from local.sim.engines import A10_QWQ32B, TINY


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(engine_model=TINY, **overrides):
    clock = Clock()
    return Engine(engine_model.with_overrides(**overrides) if overrides else engine_model, clock), clock


def run_to_end(engine, clock, limit=10_000):
    finished = {}
    for _ in range(limit):
        result = engine.step()
        if result is None:
            return finished
        clock.t += result.duration_s
        for out in result.outputs:
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("engine did not drain")


def tokens(start, n):
    return list(range(start, start + n))


def test_chunked_prefill_respects_token_budget_and_emits_first_token_after_last_chunk():
    engine, clock = make()                        # budget 16 tokens per step
    engine.add_request("a", tokens(0, 20), max_tokens=3)
    first = engine.step()
    assert first.num_prefill_tokens == 16 and first.outputs == []
    clock.t += first.duration_s
    second = engine.step()
    assert second.num_prefill_tokens == 4
    assert [(o.request_id, o.first_token) for o in second.outputs] == [("a", True)]


def test_decode_and_prefill_share_the_budget():
    engine, clock = make()
    engine.add_request("a", tokens(0, 8), max_tokens=10)
    clock.t += engine.step().duration_s           # a prefilled, first token out
    engine.add_request("b", tokens(100, 30), max_tokens=2)
    step = engine.step()
    assert step.num_decode_seqs == 1 and step.num_prefill_tokens == 15   # 16 - 1 decode token


def test_max_num_seqs_limits_the_batch():
    engine, _ = make(max_num_batched_tokens=64)
    for i in range(6):
        engine.add_request(f"r{i}", tokens(i * 10, 4), max_tokens=5)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (4, 2)


def test_admission_waits_for_free_blocks():
    engine, clock = make(max_num_batched_tokens=64)  # 16 blocks of 4 tokens
    engine.add_request("big", tokens(0, 48), max_tokens=4)      # 12 blocks at admission
    engine.add_request("next", tokens(1000, 20), max_tokens=4)  # 5 blocks: does not fit yet
    clock.t += engine.step().duration_s
    assert [r.request_id for r in engine.running] == ["big"]
    assert engine.stats().num_waiting == 1
    finished = run_to_end(engine, clock)
    assert set(finished) == {"big", "next"}
    assert engine.stats().kv_cache_usage == 0.0


def test_preemption_frees_newest_and_recomputes():
    engine, clock = make(max_num_batched_tokens=64)
    engine.add_request("old", tokens(0, 28), max_tokens=12)     # 7 blocks, grows to 10
    engine.add_request("new", tokens(500, 28), max_tokens=12)
    clock.t += engine.step().duration_s                           # both prefilled: 14 blocks
    preempted_seen = False
    finished = {}
    while engine.has_work():
        result = engine.step()
        clock.t += result.duration_s
        if engine.num_preemptions and not preempted_seen:
            preempted_seen = True
            assert [r.request_id for r in engine.waiting] == ["new"]
            assert engine.waiting[0].num_computed == 0
            assert [r.request_id for r in engine.running] == ["old"]
        finished.update({o.request_id: o for o in result.outputs if o.finished})
    assert preempted_seen and engine.stats().num_preemptions >= 1
    assert finished["old"].num_output_tokens == 12 and finished["new"].num_output_tokens == 12


def test_prefix_cache_hits_skip_shared_prefill_and_survive_finish():
    engine, clock = make(max_num_batched_tokens=64)
    shared = tokens(0, 16)                                       # 4 full blocks
    engine.add_request("a", shared + tokens(100, 6), max_tokens=1)
    run_to_end(engine, clock)
    assert engine.stats().kv_cache_usage == 0.0                  # freed, but still cached
    engine.add_request("b", shared + tokens(200, 6), max_tokens=1)
    step = engine.step()
    assert step.num_prefill_tokens == 6                          # only the tail is computed
    stats = engine.stats()
    assert stats.prefix_cache_hits == 16
    assert stats.prefix_cache_queries == 44


def test_evicts_least_recently_used_cached_blocks_when_space_is_needed():
    engine, clock = make(max_num_batched_tokens=64)
    engine.add_request("a", tokens(0, 32), max_tokens=1)         # 8 cached blocks after finish
    run_to_end(engine, clock)
    engine.add_request("b", tokens(1000, 44), max_tokens=1)      # needs 11 blocks: evicts 3
    run_to_end(engine, clock)
    assert len(engine.refs) == 8 + 11 - 3 and len(engine.evictable) == 16
    engine.add_request("c", tokens(0, 32), max_tokens=1)
    engine.step()
    # a's blocks were the oldest; a finished request frees its tail first (vLLM's order), so
    # its 3 last blocks went and c still hits the first 5.
    assert engine.stats().prefix_cache_hits == 5 * 4


def test_step_time_formula_and_histograms_use_the_clock():
    engine_model = A10_QWQ32B
    engine, clock = make(engine_model)
    clock.t = 100.0
    engine.add_request("a", tokens(0, 1000), max_tokens=2)
    prefill = engine.step()
    expected = engine_model.pipeline_stages * (engine_model.stage_base_s + 1000 * engine_model.stage_prefill_token_s
                                          + 1000 * engine_model.stage_context_token_s)
    assert prefill.duration_s == pytest.approx(expected)
    assert prefill.end_time == pytest.approx(100.0 + expected)
    clock.t = prefill.end_time
    decode = engine.step()
    expected_decode = engine_model.pipeline_stages * (engine_model.stage_base_s + engine_model.stage_decode_seq_s
                                                 + 1001 * engine_model.stage_context_token_s)
    assert decode.duration_s == pytest.approx(expected_decode)
    assert engine.ttft.sum == pytest.approx(expected)
    assert engine.itl.sum == pytest.approx(expected_decode)
    assert engine.e2e.sum == pytest.approx(expected + expected_decode)


def test_stop_at_ends_early_with_reason_stop():
    engine, clock = make()
    engine.add_request("a", tokens(0, 4), max_tokens=10, stop_at=3)
    finished = run_to_end(engine, clock)
    assert finished["a"].finish_reason == "stop" and finished["a"].num_output_tokens == 3


def test_rejects_requests_over_max_model_len_and_empty_prompts():
    engine, _ = make()
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request("a", tokens(0, 60), max_tokens=10)
    with pytest.raises(ValueError):
        engine.add_request("b", [], max_tokens=1)


def test_abort_frees_blocks():
    engine, _ = make()
    engine.add_request("a", tokens(0, 12), max_tokens=4)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    assert engine.abort("a") and engine.stats().kv_cache_usage == 0
    assert engine.request_success["abort"] == 1


def test_block_hashes_are_chained():
    a = block_hashes(tokens(0, 8), 4)
    b = block_hashes(tokens(100, 4) + tokens(4, 4), 4)
    assert len(a) == 2 and a[1] != b[1]            # same second block, different prefix
    assert block_hashes(tokens(0, 7), 4) == a[:1]  # partial blocks are not hashed


def test_a_non_streaming_engine_gives_the_same_token_times_and_schedule():
    """stream=False (the lab's engines) skips the per-token outputs and histograms; each finished
    request carries its tokens' times instead, equal to what the stream delivered, and every step
    (preemptions, cache hits, KV events) is the same."""
    import random
    rng = random.Random(7)
    shared = tokens(1000, 24)
    work = [(f"r{i}", (shared if i % 2 else []) + tokens(100 * i, rng.randint(1, 20)),
             rng.randint(1, 12)) for i in range(14)]

    def drive(stream):
        clock = Clock()
        engine = Engine(TINY, clock, kv_events=True, stream=stream)
        seen, times, steps = {}, {}, []
        arrivals = list(work)
        while arrivals or engine.has_work():
            if arrivals and (not engine.has_work() or rng_steps.random() < 0.6):
                rid, ids, n = arrivals.pop(0)
                engine.add_request(rid, ids, max_tokens=n)
            result = engine.step()
            if result is None:
                continue
            clock.t = result.end_time
            steps.append((result.duration_s, result.num_prefill_tokens, result.num_decode_seqs,
                          [r.request_id for r in result.finished], engine.take_kv_events()))
            for out in result.outputs:
                seen.setdefault(out.request_id, []).append(result.end_time)
            for r in result.finished:
                times[r.request_id] = (r.first_token_time, r.token_gaps, r.last_token_time,
                                       r.num_output)
        return seen, times, steps, engine.num_preemptions

    rng_steps = random.Random(3)
    streamed, _, steps_streamed, preempted = drive(True)
    rng_steps = random.Random(3)
    outputs, times, steps, preempted_too = drive(False)
    assert outputs == {} and steps == steps_streamed and preempted == preempted_too > 0
    assert set(times) == set(streamed) == {rid for rid, _, _ in work}
    for rid, stamps in streamed.items():
        first, gaps, last, n = times[rid]
        assert (first, last, n) == (stamps[0], stamps[-1], len(stamps))
        assert gaps == [b - a for a, b in zip(stamps, stamps[1:])]


@pytest.mark.parametrize("seed", range(6))
def test_stretches_of_decode_steps_change_nothing(seed):
    """decode_runs=True plans stretches of pure decode steps and applies them without a pass over
    the requests: every step's time, the finished requests, the KV events, the blocks and (once
    synced) every request's counters and token times equal those of plain steps, with requests
    arriving at random steps, shared prefixes, evictions and preemptions."""
    import random
    model = TINY.with_overrides(num_gpu_blocks=48, max_num_seqs=6, max_num_batched_tokens=24,
                                max_model_len=96)
    rng = random.Random(seed)
    shared = tokens(5000, 16)
    work = [(f"r{i}", (shared if rng.random() < 0.5 else []) + tokens(100 * i, rng.randint(1, 24)),
             rng.randint(1, 60)) for i in range(30)]
    arrive = sorted(rng.sample(range(400), len(work)))

    def drive(runs):
        clock = Clock()
        engine = Engine(model, clock, kv_events=True, stream=False, decode_runs=runs)
        trace, added, step, in_stretch = [], 0, 0, 0
        while added < len(work) or engine.has_work():
            while added < len(work) and arrive[added] <= step:
                rid, ids, n = work[added]
                engine.add_request(rid, ids, max_tokens=n)
                added += 1
            step += 1
            result = engine.step()
            if result is None:
                continue
            clock.t = result.end_time
            in_stretch += engine._run is not None
            engine.sync()
            trace.append((result.duration_s, result.end_time, result.num_decode_seqs,
                          [(r.request_id, r.first_token_time, list(r.token_gaps), r.num_output)
                           for r in result.finished],
                          engine.take_kv_events(), engine.used, len(engine.evictable),
                          sorted((r.request_id, r.num_output, r.num_computed, r.last_token_time,
                                  len(r.token_gaps)) for r in engine.running)))
        return (trace, engine.stats(), engine.num_preemptions), in_stretch

    (plain, none), (stretched, some) = drive(False), drive(True)
    assert plain == stretched
    assert none == 0 and some > 50      # many steps were stretch steps


def test_a_copied_engine_has_every_field_of_every_request():
    """Engine.copy writes each request field out by hand: a field added to EngineRequest and
    not copied fails here. The copy's cached-block list is its own; its block hashes are the
    original's list, which a copy only extends with the hashes the request will have."""
    from local.sim.engine import EngineRequest
    engine, clock = make()
    engine.add_request("a", tokens(0, 9), max_tokens=8)
    engine.add_request("b", tokens(0, 13), max_tokens=3)
    for _ in range(3):
        clock.t += engine.step().duration_s
    copy_clock = Clock()
    copy_clock.t = clock.t
    copy = engine.copy(copy_clock)
    reset = {"hashed", "token_gaps", "_hit_epoch", "_hit_blocks", "_hit_evictions"}
    for rid, r in engine.requests.items():
        c = copy.requests[rid]
        for name in EngineRequest.__slots__:
            if name not in reset:
                assert getattr(c, name) == getattr(r, name), name
        assert c.hashed == r.hashed and c.hashed is not r.hashed and c.token_gaps == []
        assert c.block_hashes is r.block_hashes
    assert [r.request_id for r in copy.running] == [r.request_id for r in engine.running]
    assert copy.refs == engine.refs and copy.refs is not engine.refs

    def drain(e, clk):
        done = {}
        while (result := e.step()) is not None:
            clk.t = result.end_time
            done.update((r.request_id, (r.num_output, r.last_token_time)) for r in result.finished)
        return done
    copied = drain(copy, copy_clock)                   # first: it extends the shared hashes
    assert drain(engine, clock) == copied and set(copied) == {"a", "b"}
