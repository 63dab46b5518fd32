"""Following an engine's cache from its events: sync, gaps and replays, restarts, bad input and
bounds (signals/kvstate.py), and the workers' index (scheduling/kvindex.py)."""
from __future__ import annotations

import logging

import pytest

from kvsamples import capture, map_payload, messages, payload, removed, stored
from picker.scheduling.kvindex import PreciseIndex
from picker.signals.kvstate import (FLOODING, JOINED_LATE, MALFORMED, NO_EVENTS, REPLAY_FAILED,
                                    SILENT, SYNCING, KVTracker, chain_hashes)

A = "10.0.0.1:8000"


def feed(tracker: KVTracker, index: PreciseIndex | None = None):
    def apply():
        deltas = tracker.take_deltas()
        if index is not None:
            index.apply(deltas)
    return apply


def expected_blocks(lines: list[dict]) -> dict:
    """The engine's cached blocks after these messages, from the capture's schema-less decode
    (independent of the picker's decoder): engine hash -> the block's token ids."""
    held: dict = {}
    for m in lines:
        for ev in m["decoded"][1]:
            if ev["type"] == "BlockStored":
                bs = ev["block_size"]
                for i, h in enumerate(ev["block_hashes"]):
                    held[h] = (ev["parent_block_hash"] if i == 0 else ev["block_hashes"][i - 1],
                               ev["token_ids"][i * bs:(i + 1) * bs])
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    held.pop(h, None)
            else:
                held.clear()
    return held


def prompt300_tokens() -> list[int]:
    first = messages("blocks64")[0]
    assert first["step"] == "prompt300"
    return first["decoded"][1][0]["token_ids"]


def test_blocks64_run_index_reflects_the_engines_evictions():
    lines = messages("blocks64")
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.set_capacity(A, 64, 128)
    apply = feed(tracker, index)
    chain = chain_hashes(prompt300_tokens(), 128)
    assert len(chain) == 10
    leading_by_step = {}
    engine_chain = lines[0]["decoded"][1][0]["block_hashes"]
    for i, m in enumerate(lines):
        tracker.on_message(A, m["sequence"], payload(m), float(i))
        apply()
        want = expected_blocks(lines[:i + 1])
        assert set(tracker.endpoints[A].blocks) == set(want)
        assert index.size(A) == len(want) <= 64
        # prompt300's cached prefix: its leading blocks the engine still holds
        leading = 0
        for h in engine_chain:
            if h not in want:
                break
            leading += 1
        assert index.match(chain).get(A, 0) == leading, m["step"]
        leading_by_step[m["step"]] = leading
    # LRU: the oldest prompt's blocks went first, then it came back in full
    assert leading_by_step["prompt300"] == 10
    assert min(leading_by_step[f"long_{i}"] for i in range(6)) < 10
    assert leading_by_step["prompt300_after_evictions"] == 10
    st = tracker.endpoints[A].stats
    assert st.batches == len(lines) and st.gaps == 0 and st.malformed == 0
    assert st.events == sum(len(m["decoded"][1]) for m in lines)
    # after prompt300_after_evictions and chat, prompt300 is cached again in full
    assert index.match(chain) == {A: 10}


def test_own_hashes_follow_the_engines_chain():
    """A block stored as an extension of a cached prefix chains on the parent's own hash, so
    the request's chain over the whole prompt matches both events' blocks."""
    lines = messages("extras")
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    for m in lines[:2]:
        tracker.on_message(A, m["sequence"], payload(m), 0.0)
    index.apply(tracker.take_deltas())
    tokens = lines[0]["decoded"][1][0]["token_ids"] + lines[1]["decoded"][1][0]["token_ids"]
    assert index.match(chain_hashes(tokens, 128)) == {A: 14}
    assert index.match(chain_hashes(tokens[128:], 128)) == {}  # not a prefix
    # the LoRA adapter seeds the chain: the base model's blocks are not the adapter's
    from picker.signals.kvstate import root_seed
    assert index.match(chain_hashes(tokens, 128, root_seed("adapter"))) == {}


def test_gap_is_repaired_by_a_replay():
    lines = messages("blocks64")
    replay_answer = [(m["sequence"], payload(m)) for m in capture()
                     if m["run"] == "blocks64" and m["source"] == "replay" and m.get("payload_len")]
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, payload(lines[0]), 0.0)
    tracker.on_message(A, 4, payload(lines[4]), 0.1)  # 1..3 lost
    assert tracker.endpoints[A].reason == SYNCING and tracker.endpoints[A].stats.gaps == 1
    index.apply(tracker.take_deltas())
    assert not index.in_sync(A) and index.size(A) == 0  # falls back while repairing
    assert tracker.due_replays(0.2) == [(A, 1)]
    tracker.on_message(A, 5, payload(lines[5]), 0.3)    # held until the replay answers
    tracker.on_replay(A, 1, [m for m in replay_answer if m[0] >= 1], True, 0.4)
    for m in lines[6:]:
        tracker.on_message(A, m["sequence"], payload(m), 0.5)
    index.apply(tracker.take_deltas())
    assert index.in_sync(A)
    assert set(tracker.endpoints[A].blocks) == set(expected_blocks(lines))
    assert index.size(A) == len(expected_blocks(lines))


def test_subscribing_late_asks_for_the_whole_history():
    lines = messages("blocks64")
    tracker = KVTracker()
    tracker.add(A, 0.0)                                 # replay from 0 first
    assert tracker.due_replays(0.0) == [(A, 0)]
    tracker.on_message(A, 8, payload(lines[8]), 0.1)
    history = [(m["sequence"], payload(m)) for m in lines[:8]]
    tracker.on_replay(A, 0, history, True, 0.2)
    assert tracker.endpoints[A].in_sync
    assert set(tracker.endpoints[A].blocks) == set(expected_blocks(lines))


def test_joining_late_follows_from_the_first_batch_available():
    """The replay buffer no longer starts at 0: what the engine held before is unknown (as to a
    freshly started picker), everything from the replay on is exact."""
    lines = messages("extras")
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0)
    tracker.due_replays(0.0)
    tracker.on_replay(A, 0, [(m["sequence"], payload(m)) for m in lines[2:5]], True, 0.1)
    index.apply(tracker.take_deltas())
    ep = tracker.endpoints[A]
    assert ep.in_sync and index.in_sync(A) and ep.expected == 5 and ep.stats.late_joins == 1
    decode_tokens = [t for m in lines[2:5] for t in m["decoded"][1][0]["token_ids"]]
    assert index.match(chain_hashes(decode_tokens, 128)) == {A: 3}   # the chained decode blocks
    prompt = lines[0]["decoded"][1][0]["token_ids"]
    assert index.match(chain_hashes(prompt, 128)) == {}               # stored before: unknown


def test_gap_the_replay_cannot_fill_falls_back_until_the_cache_is_cleared(caplog):
    lines = messages("extras")
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, payload(lines[0]), 0.0)
    tracker.on_message(A, 3, payload(lines[3]), 0.1)      # 1 and 2 lost
    assert tracker.due_replays(0.1) == [(A, 1)]
    with caplog.at_level(logging.WARNING, "picker.kvevents"):
        tracker.on_replay(A, 1, [(m["sequence"], payload(m)) for m in lines[2:4]], True, 0.2)
        ep = tracker.endpoints[A]
        assert ep.reason == JOINED_LATE and not ep.in_sync
        index.apply(tracker.take_deltas())
        assert not index.in_sync(A) and index.size(A) == 0
        tracker.on_message(A, 4, payload(lines[4]), 0.3)  # still out: dropped
        assert not ep.in_sync and ep.stats.dropped == 1
        tracker.on_message(A, 5, payload(lines[5]), 0.4)  # AllBlocksCleared: known empty
    index.apply(tracker.take_deltas())
    assert ep.in_sync and index.in_sync(A) and not ep.blocks
    assert len([r for r in caplog.records if getattr(r, "reason", "") == JOINED_LATE]) == 1


def test_restart_starts_empty_and_resyncs():
    lines = messages("default")
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, payload(lines[0]), 0.0)
    tracker.on_message(A, 1, payload(lines[1]), 0.0)
    index.apply(tracker.take_deltas())
    assert index.size(A) == 17
    tracker.on_message(A, 0, payload(lines[0]), 1.0)    # a new engine: sequence from 0 again
    index.apply(tracker.take_deltas())
    assert index.size(A) == 0 and tracker.endpoints[A].reason == SYNCING
    assert tracker.due_replays(1.0) == [(A, 0)]
    tracker.on_replay(A, 0, [(0, payload(lines[0]))], True, 1.1)
    index.apply(tracker.take_deltas())
    assert index.in_sync(A) and index.size(A) == 10


def test_malformed_batch_falls_back_counted_and_logged_once(caplog):
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, map_payload([stored([1], None, [5] * 16, 16)]), 0.0)
    with caplog.at_level(logging.WARNING, "picker.kvevents"):
        tracker.on_message(A, 1, b"\x93\xcb garbage", 0.1)
        tracker.on_message(A, 2, map_payload([{"type": "BlockStored"}]), 0.2)
    index.apply(tracker.take_deltas())
    ep = tracker.endpoints[A]
    assert ep.reason == MALFORMED and not index.in_sync(A) and index.size(A) == 0
    assert ep.stats.malformed == 2
    assert len([r for r in caplog.records if getattr(r, "reason", "") == MALFORMED]) == 1
    # a BlockStored whose token ids do not fill its blocks is malformed too, and nothing of
    # its batch is applied
    t2 = KVTracker()
    t2.add(A, 0.0, replay=False)
    t2.on_message(A, 0, map_payload([removed([9]), stored([1, 2], None, [5] * 20, 16)]), 0.0)
    assert t2.endpoints[A].reason == MALFORMED and t2.endpoints[A].stats.batches == 0


def test_unknown_kind_is_counted_and_the_rest_applied():
    tracker = KVTracker()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, map_payload([{"type": "BlockPinned", "x": 1},
                                          stored([1], None, [5] * 16, 16)]), 0.0)
    ep = tracker.endpoints[A]
    assert ep.in_sync and ep.stats.unknown == 1 and list(ep.blocks) == [1]


def test_huge_batch_is_capped_at_the_engines_capacity():
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.set_capacity(A, 100, 16)
    n = 5000
    tokens = list(range(16)) * n
    tracker.on_message(A, 0, map_payload([stored(list(range(1, n + 1)), None, tokens, 16)]), 0.0)
    index.apply(tracker.take_deltas())
    ep = tracker.endpoints[A]
    assert len(ep.blocks) == 100 and index.size(A) == 100 and ep.stats.overflow == n - 100
    assert list(ep.blocks)[0] == n - 99  # the newest kept
    assert ep.in_sync


def test_flooding_publisher_falls_back_then_resyncs_by_replay():
    tracker = KVTracker(bytes_per_second=10_000, retry_after=1.0)
    tracker.add(A, 0.0, replay=False)
    big = map_payload([stored([7], None, [1] * 16, 16)]) + b""
    seq = 0
    for i in range(200):  # ~ 100 bytes each, 200 in 0.1 s: 200 kB/s
        tracker.on_message(A, seq, big, i * 0.0005)
        seq += 1
    ep = tracker.endpoints[A]
    assert ep.reason == FLOODING and ep.stats.dropped > 0 and not ep.blocks
    tracker.on_message(A, seq, big, 2.0)               # calm again, after the back-off
    assert ep.reason == SYNCING
    start = tracker.due_replays(2.0)[0][1]
    assert start == ep.expected
    tracker.on_replay(A, start, [(s, big) for s in range(start, seq)], True, 2.1)
    assert ep.in_sync and ep.expected == seq + 1


def test_no_replay_answer_follows_from_the_next_batch_and_a_failed_gap_replay_retries():
    tracker = KVTracker(replay_timeout=2.0, retry_after=5.0)
    tracker.add(A, 0.0)
    assert tracker.due_replays(0.0) == [(A, 0)]
    assert tracker.due_replays(1.0) == []
    tracker.due_replays(2.5)                            # no answer: follow from the next batch
    ep = tracker.endpoints[A]
    assert not ep.in_sync and ep.reason == NO_EVENTS    # nothing known yet
    tracker.on_message(A, 7, map_payload([stored([1], None, [1] * 16, 16)]), 3.0)
    assert ep.in_sync and ep.expected == 8 and list(ep.blocks) == [1]
    assert ep.stats.late_joins == 1
    tracker.on_message(A, 9, map_payload([stored([2], 1, [1] * 16, 16)]), 3.1)  # 8 lost
    assert tracker.due_replays(3.1) == [(A, 8)]
    tracker.due_replays(5.5)                            # this replay times out too: out
    assert ep.reason == REPLAY_FAILED and not ep.blocks
    tracker.on_message(A, 10, map_payload([stored([3], None, [1] * 16, 16)]), 6.0)
    assert ep.reason == REPLAY_FAILED                   # before the back-off: stays out
    tracker.on_message(A, 11, map_payload([stored([4], None, [1] * 16, 16)]), 11.0)
    assert ep.reason == SYNCING and tracker.due_replays(11.0) == [(A, 11)]


def test_silent_publisher_falls_back_while_the_engine_computes():
    tracker, index = KVTracker(silence=5.0), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.set_capacity(A, 1000, 16)
    tracker.on_message(A, 0, map_payload([stored([1], None, [1] * 16, 16)]), 0.0)
    tracker.on_activity(A, 16.0, 0.1)
    for t in range(1, 10):                               # idle engine: silence is fine
        tracker.on_activity(A, 16.0, float(t))
    assert tracker.endpoints[A].in_sync
    tracker.on_activity(A, 16.0 + 16 * 20, 10.0)         # 20 blocks computed, no events
    assert tracker.endpoints[A].in_sync                  # not yet: within the bound
    tracker.on_activity(A, 16.0 + 16 * 40, 16.0)
    index.apply(tracker.take_deltas())
    assert not tracker.endpoints[A].in_sync and not index.in_sync(A) and index.size(A) == 0
    assert tracker.status()[A][1] == SILENT
    tracker.on_message(A, 1, map_payload([stored([2], 1, [2] * 16, 16)]), 17.0)
    index.apply(tracker.take_deltas())
    assert index.in_sync(A) and index.size(A) == 2


def test_removed_endpoint_leaves_the_index():
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.add("b:1", 0.0, replay=False)
    same = map_payload([stored([1, 2], None, [1] * 32, 16)])
    tracker.on_message(A, 0, same, 0.0)
    tracker.on_message("b:1", 0, same, 0.0)
    index.apply(tracker.take_deltas())
    chain = chain_hashes([1] * 32, 16)
    assert index.match(chain) == {A: 2, "b:1": 2}
    index.forget(A)
    tracker.remove(A)
    index.apply(tracker.take_deltas())
    assert index.match(chain) == {"b:1": 2} and index.size(A) == 0 and index.size() == 2


@pytest.mark.parametrize("n", [1, 3])
def test_removed_then_stored_again_in_one_delta_stays(n):
    tracker, index = KVTracker(), PreciseIndex()
    tracker.add(A, 0.0, replay=False)
    tracker.on_message(A, 0, map_payload([stored([1], None, [1] * 16, 16)]), 0.0)
    for i in range(n):
        tracker.on_message(A, 1 + 2 * i, map_payload([removed([1])]), 0.0)
        tracker.on_message(A, 2 + 2 * i, map_payload([stored([1], None, [1] * 16, 16)]), 0.0)
    index.apply(tracker.take_deltas())
    assert index.match(chain_hashes([1] * 16, 16)) == {A: 1}


def test_engine_started_after_subscribing_needs_no_replay_socket():
    tracker = KVTracker(replay_timeout=1.0)
    tracker.add(A, 0.0)
    assert tracker.due_replays(0.0) == [(A, 0)]
    tracker.on_message(A, 0, map_payload([stored([1], None, [1] * 16, 16)]), 0.5)
    tracker.on_message(A, 1, map_payload([stored([2], 1, [2] * 16, 16)]), 0.6)
    tracker.due_replays(1.5)                            # the replay timed out ...
    ep = tracker.endpoints[A]
    assert ep.in_sync and list(ep.blocks) == [1, 2]     # ... but seq 0 onwards is here
