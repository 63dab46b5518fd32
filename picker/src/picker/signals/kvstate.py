"""What each engine holds in its KV cache, followed from its KV-cache events.

Pure (no I/O, clock passed in): the subscriber in the signals process feeds it messages and
replay answers; the Router feeds it decoded batches in process (lab, tests).

Block identity. vLLM names a block by its own chained hash (SHA-256 of the parent's hash, the
block's token ids and extra keys); the picker does not reproduce it. For every stored block it
computes its own chained hash from the token ids the event carries (`chain_hashes`, xxh3-64
seeded with the parent's own hash, the first block with the LoRA adapter), and keeps, per
endpoint, engine hash -> own hash to apply removals. A request's prompt, tokenized by the
picker and cut into the endpoint's block size, gives the same chain: its longest prefix held by
an endpoint is what that endpoint has cached.

Sync. Subscribing asks the replay socket for the engine's whole history (from sequence 0).
If its buffer no longer starts at 0, or there is no replay socket, the endpoint is followed
from the first batch available: what the engine cached before is unknown, as it is to the
approximate index of a picker that just started, and everything from there on is exact (the
endpoint counts as in sync; `late_joins` counts these). Later, every batch must be applied in
order: a gap asks for a replay from the first missing sequence, and until it is answered in
full the endpoint is out of sync and routing falls back to the approximate index for it (which
then knows more than a state with holes); if the replay cannot fill it, it stays so until the
engine clears its cache or restarts. A sequence going back means the engine restarted: its
blocks are dropped and the sync starts again from 0.

Bounds: the blocks tracked per endpoint are capped at its KV capacity (num_gpu_blocks, else
KV_DEFAULT_MAX_BLOCKS), oldest first; messages held while a replay runs, and the payload bytes
decoded per second, are capped too (a flooding publisher falls back instead of taking the CPU).

Why one file of this size: per endpoint, one state machine (sync, gaps, replay, restarts, bounds)
whose transitions read and write the same few fields; the tests drive it through the recorded
vLLM frames as one unit.
"""
from __future__ import annotations

import itertools
import logging
from array import array
from dataclasses import dataclass, field

import xxhash

from picker import defaults
from picker.signals.kvevents import (AllBlocksCleared, BlockRemoved, BlockStored,
                                     EventBatch, KVEventsError, decode_payload)

log = logging.getLogger("picker.kvevents")

_hash = xxhash.xxh3_64_intdigest

# Why an endpoint is out of sync (metric label values; "" = in sync).
SYNCING = "syncing"            # waiting for a replay answer
JOINED_LATE = "history_lost"   # the replay buffer no longer holds the start, or a gap's batches
REPLAY_FAILED = "replay_failed"
MALFORMED = "malformed"
FLOODING = "flooding"
SILENT = "silent"
NO_EVENTS = "no_events"        # nothing received yet and no replay asked


def _digest(item) -> int | None:
    return _hash(item) if isinstance(item, (bytes, bytearray, memoryview)) else id(item)


def root_seed(lora_name: str | None, lora_id: int | None = None) -> int:
    """Seed of a chain's first block: the base model (0) or the LoRA adapter. Old vLLM versions
    name the adapter only by its number: such blocks get a seed no request computes."""
    if lora_name:
        return _hash(lora_name.encode("utf-8", "surrogatepass"))
    if lora_id:
        return _hash(b"lora-id:%d" % lora_id)
    return 0


def chain_hashes(token_ids, block_size: int, seed: int = 0, max_blocks: int | None = None,
                 extra: list | None = None) -> list[int]:
    """Own chained hashes of the full blocks of `token_ids` (list or array('I')): block i is
    xxh3-64 of its token ids (uint32) seeded with block i-1's hash (block 0 with `seed`). A
    block with extra keys (multimodal inputs, cache salt) mixes them in, so no plain prompt
    matches it."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return []
    arr = token_ids if isinstance(token_ids, array) else array("I", token_ids[: n * block_size])
    mv = memoryview(arr).cast("B")
    step = block_size * 4
    out = []
    h = seed
    for i in range(n):
        h = _hash(mv[i * step:(i + 1) * step], h)
        if extra is not None and extra[i] is not None:
            h = _hash(repr(extra[i]).encode(), h)
        out.append(h)
    return out


@dataclass(slots=True)
class KVStats:
    batches: int = 0
    events: int = 0
    unknown: int = 0           # events of an unknown kind, skipped
    malformed: int = 0         # batches that did not fit the schema
    gaps: int = 0
    replays: int = 0
    dropped: int = 0           # messages dropped: flooding, out of sync, backlog full
    overflow: int = 0          # blocks evicted by the cap (more stored than the engine holds)
    late_joins: int = 0        # syncs that started after the engine's start (history unknown)
    lag: float = 0.0           # receive time - the batch's own timestamp, last batch (s)

    def as_tuple(self) -> tuple:
        return (self.batches, self.events, self.unknown, self.malformed, self.gaps, self.replays,
                self.dropped, self.overflow, self.lag, self.late_joins)


STAT_FIELDS = ("batches", "events", "unknown", "malformed", "gaps", "replays", "dropped",
               "overflow", "lag", "late_joins")


@dataclass(slots=True)
class EndpointKV:
    address: str
    blocks: dict = field(default_factory=dict)   # engine hash -> own hash, oldest first
    block_size: int | None = None
    capacity: int = defaults.KV_DEFAULT_MAX_BLOCKS
    reason: str = NO_EVENTS        # "" = in sync
    expected: int | None = None    # next sequence number
    held: list = field(default_factory=list)     # (seq, payload) held while a replay runs
    replay_from: int | None = None               # a replay to ask for (the subscriber asks)
    replay_started: float | None = None
    retry_at: float | None = None                # out of sync: ask for a replay again then
    stats: KVStats = field(default_factory=KVStats)
    logged: set = field(default_factory=set)     # reasons already logged (once each)
    budget: float = 0.0                          # payload bytes it may still decode now
    budget_at: float | None = None
    # silence: prompt tokens the engine computed (metrics) against the batches it published
    computed_base: float | None = None
    computed_base_at: float = 0.0
    batches_since_scrape: int = 0
    silent: bool = False
    dups: dict | None = None                     # seq -> digest of the last replay's batches

    @property
    def in_sync(self) -> bool:
        return self.reason == "" and not self.silent


# One change for the workers' indexes: (address, in_sync, reason, block_size, added own
# hashes, removed own hashes). Going out of sync removes every block the endpoint held, coming
# into sync adds every block it holds: the workers never need to scan their index.
Delta = tuple


class _Pending:
    """An endpoint's changes since the last take_deltas(): the net change per own hash (last
    write wins, so a block removed and stored again within one delta stays)."""
    __slots__ = ("changes",)

    def __init__(self):
        self.changes: dict[int, bool] = {}


class KVTracker:
    """Per-endpoint sync state and engine -> own block hashes, for the endpoints followed."""

    def __init__(self, max_pending: int = defaults.KV_MAX_PENDING,
                 bytes_per_second: float = defaults.KV_MAX_BYTES_PER_SECOND,
                 replay_timeout: float = defaults.KV_REPLAY_TIMEOUT,
                 retry_after: float = defaults.KV_RESYNC_BACKOFF,
                 silence: float = defaults.KV_SILENCE_SECONDS,
                 max_blocks: int = defaults.KV_MAX_BLOCKS_PER_ENDPOINT):
        self.endpoints: dict[str, EndpointKV] = {}
        self.max_pending = max_pending
        self.bytes_per_second = bytes_per_second
        self.replay_timeout = replay_timeout
        self.retry_after = retry_after
        self.silence = silence
        self.max_blocks = max_blocks
        self._pending: dict[str, _Pending] = {}
        self._gone: dict[str, _Pending] = {}   # endpoints removed since the last take_deltas

    # ---- endpoints ---------------------------------------------------------------------------
    def add(self, address: str, now: float, replay: bool = True) -> EndpointKV:
        """Follow an endpoint; with `replay` its whole history is asked for first (subscriber),
        without it the caller delivers every batch from the engine's start (lab)."""
        ep = self.endpoints.get(address)
        if ep is None:
            ep = self.endpoints[address] = EndpointKV(address)
            ep.budget, ep.budget_at = self.bytes_per_second, now
            if replay:
                self._ask_replay(ep, 0)
            else:
                ep.reason, ep.expected = "", 0
                self._full(ep)
        return ep

    def remove(self, address: str) -> None:
        """Stop following an endpoint (it left the pool); its blocks go from the indexes."""
        ep = self.endpoints.get(address)
        if ep is not None:
            ep.reason = NO_EVENTS
            self._drop_all(ep)
            self._gone[address] = self._changes(ep)
            del self.endpoints[address]
            del self._pending[address]

    def set_capacity(self, address: str, num_gpu_blocks: int | None, block_size: int | None) -> None:
        ep = self.endpoints.get(address)
        if ep is None:
            return
        if num_gpu_blocks:
            ep.capacity = min(num_gpu_blocks, self.max_blocks)
        if block_size and ep.block_size is None:
            ep.block_size = block_size
            self._changes(ep)

    def on_activity(self, address: str, computed_tokens: float | None, now: float) -> None:
        """The prompt tokens the engine computed so far (its metrics, at each scrape). Full
        blocks computed while no batch arrives for the silence bound: the publisher is silent,
        and the endpoint falls back until a batch arrives."""
        ep = self.endpoints.get(address)
        if ep is None or computed_tokens is None:
            return
        if ep.computed_base is None or computed_tokens <= ep.computed_base or ep.batches_since_scrape:
            # a batch arrived since the last scrape, or no new work: nothing unexplained now
            ep.computed_base, ep.computed_base_at = computed_tokens, now
            ep.batches_since_scrape = 0
        bs = ep.block_size or defaults.KV_ASSUMED_BLOCK_SIZE
        silent = (computed_tokens - ep.computed_base >= defaults.KV_SILENT_BLOCKS * bs
                  and now - ep.computed_base_at >= self.silence)
        if silent != ep.silent:
            ep.silent = silent
            if silent:
                self._note(ep, SILENT, "no KV events while the engine computed new blocks")
            self._full(ep)

    # ---- input -------------------------------------------------------------------------------
    def on_message(self, address: str, seq: int, payload: bytes | EventBatch, now: float,
                   wall_now: float | None = None) -> None:
        """A live message from the endpoint's publisher (payload bytes, or a decoded batch)."""
        ep = self.endpoints.get(address)
        if ep is None:
            return
        size = len(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else 0
        if not self._admit(ep, size, now):
            return
        if ep.dups is not None:
            if ep.expected is not None and seq < ep.expected and ep.dups.get(seq) == _digest(payload):
                return                    # published before the replay answered, read after it
            ep.dups = None                # the subscription has caught up with the replay
        if ep.expected is not None and seq < ep.expected:
            self._restart(ep)             # the sequence went back: a new engine
        if ep.reason == SYNCING:
            self._hold(ep, seq, payload, now)
        elif ep.reason == NO_EVENTS and ep.expected is None and ep.retry_at is None:
            ep.reason, ep.expected = "", seq  # no replay answered: follow from the first batch
            if seq > 0:
                self._joined_late(ep, seq)
            self._full(ep)
            self._apply_item(ep, seq, payload, now, wall_now)
        elif ep.reason == "":
            if seq == ep.expected:
                self._apply_item(ep, seq, payload, now, wall_now)
            else:
                ep.stats.gaps += 1
                self._note(ep, "gap", f"sequence gap: expected {ep.expected}, got {seq}")
                self._ask_replay(ep, ep.expected)
                self._hold(ep, seq, payload, now)
        elif seq == 0:                    # out of sync, and the engine starts afresh
            ep.reason, ep.expected = "", 0
            self._full(ep)
            self._apply_item(ep, seq, payload, now, wall_now)
        elif ep.retry_at is not None and now >= ep.retry_at and ep.expected is not None:
            self._ask_replay(ep, ep.expected)
            self._hold(ep, seq, payload, now)
        else:
            self._apply_out_of_sync(ep, seq, payload, now)

    def on_batch(self, address: str, batch: EventBatch, now: float, seq: int | None = None,
                 wall_now: float | None = None) -> None:
        """A decoded batch, in process (lab, tests). Without `seq` no order is checked: the
        caller delivers every batch since the engine started, in order."""
        ep = self.endpoints.get(address) or self.add(address, now, replay=False)
        if seq is not None:
            self.on_message(address, seq, batch, now, wall_now)
            return
        if ep.reason != "":
            ep.reason = ""
            self._full(ep)
        try:
            self._apply(ep, batch, wall_now)
        except KVEventsError as exc:
            ep.stats.malformed += 1
            self._out(ep, MALFORMED, str(exc), now)

    def on_replay(self, address: str, start: int, messages: list[tuple[int, bytes]],
                  complete: bool, now: float) -> None:
        """The replay socket's answer to a request from `start` (complete: it ended with the
        end marker; else it timed out or was cut)."""
        ep = self.endpoints.get(address)
        if ep is None or ep.reason != SYNCING or ep.replay_started is None:
            return
        ep.replay_started = None
        initial = ep.expected is None  # the first sync since subscribing (or a restart)
        messages = sorted(messages, key=lambda m: m[0])
        if not complete:
            if not initial:
                self._out(ep, REPLAY_FAILED, "no full answer from the replay socket", now,
                          retry=True)
                return
            # No replay socket, or no answer: follow from the first batch received.
            messages, held = [], sorted(ep.held, key=lambda m: m[0])
            if not held:  # nothing yet: out of sync until a batch arrives, then from there
                ep.held = []
                ep.reason = NO_EVENTS
                return
            start = held[0][0]
        if initial:
            ep.expected = messages[0][0] if messages else start
            if ep.expected > 0:
                self._joined_late(ep, ep.expected)
        elif messages and messages[0][0] > ep.expected:
            self._out(ep, JOINED_LATE, f"the replay starts at {messages[0][0]}, "
                                       f"{ep.expected} is needed", now)
            return
        ep.reason = ""
        self._full(ep)
        # Live messages already queued may repeat the replay's last batches: recognised by
        # their digest (vLLM's replay payloads are byte-identical to the live ones).
        ep.dups = {seq: _digest(payload) for seq, payload in messages}
        for seq, payload in messages + self._take_held(ep):
            if seq < ep.expected:
                continue
            if seq > ep.expected:
                ep.stats.gaps += 1
                self._out(ep, JOINED_LATE, f"gap at {ep.expected} after the replay", now,
                          retry=True)
                return
            if not self._apply_item(ep, seq, payload, now, None):
                return

    def on_bad_message(self, address: str, why: str, now: float) -> None:
        """A message that is not [topic, 8-byte sequence, payload]: counted as malformed, and
        the endpoint falls back (its sequence is unknown, so a batch may be lost)."""
        ep = self.endpoints.get(address)
        if ep is not None:
            ep.stats.malformed += 1
            if ep.reason != MALFORMED:
                self._out(ep, MALFORMED, why, now)

    def fall_back_all(self, reason: str, why: str, now: float) -> None:
        """Every endpoint out of sync (the subscriber cannot follow them any more)."""
        for ep in self.endpoints.values():
            self._out(ep, reason, why, now)

    def due_replays(self, now: float) -> list[tuple[str, int]]:
        """Replays to ask for now, (address, start); replays that timed out fail here."""
        out = []
        for ep in list(self.endpoints.values()):
            if ep.replay_from is not None:
                out.append((ep.address, ep.replay_from))
                ep.replay_from = None
                ep.replay_started = now
            elif ep.replay_started is not None and now - ep.replay_started > self.replay_timeout:
                self.on_replay(ep.address, -1, [], False, now)
        return out

    def take_deltas(self) -> list[Delta]:
        out = [(addr, False, NO_EVENTS, None, [], [h for h, present in p.changes.items()
                                                  if not present])
               for addr, p in self._gone.items()]
        self._gone.clear()
        for addr, p in self._pending.items():
            ep = self.endpoints[addr]
            changes = p.changes.items()
            out.append((addr, ep.in_sync, ep.reason or (SILENT if ep.silent else ""),
                        ep.block_size, [h for h, present in changes if present],
                        [h for h, present in changes if not present]))
        self._pending.clear()
        return out

    def status(self) -> dict[str, tuple]:
        """address -> (in_sync, reason, blocks tracked, stats tuple (STAT_FIELDS))."""
        return {a: (ep.in_sync, ep.reason or (SILENT if ep.silent else ""), len(ep.blocks),
                    ep.stats.as_tuple()) for a, ep in self.endpoints.items()}

    # ---- internals ---------------------------------------------------------------------------
    def _admit(self, ep: EndpointKV, size: int, now: float) -> bool:
        """Token bucket on payload bytes per endpoint (burst: one second's worth)."""
        rate = self.bytes_per_second
        if ep.budget_at is not None:
            ep.budget = min(rate, ep.budget + (now - ep.budget_at) * rate)
        ep.budget_at = now
        if size > ep.budget:
            ep.stats.dropped += 1
            if ep.reason != FLOODING:
                self._out(ep, FLOODING, f"more than {rate:.0f} payload bytes/s", now, retry=True)
            return False
        ep.budget -= size
        return True

    def _hold(self, ep: EndpointKV, seq: int, item, now: float) -> None:
        if len(ep.held) >= self.max_pending:
            ep.stats.dropped += len(ep.held) + 1
            self._out(ep, JOINED_LATE, "too many messages while waiting for a replay", now,
                      retry=True)
            return
        ep.held.append((seq, item))

    def _take_held(self, ep: EndpointKV) -> list:
        held = sorted(ep.held, key=lambda m: m[0])
        ep.held = []
        return held

    def _ask_replay(self, ep: EndpointKV, start: int) -> None:
        was_in_sync = ep.in_sync
        ep.stats.replays += 1
        ep.replay_from = start
        ep.replay_started = None
        ep.retry_at = None
        ep.reason = SYNCING
        if was_in_sync:
            self._drop_all(ep, keep=True)

    def _restart(self, ep: EndpointKV) -> None:
        self._note(ep, "restart", "the sequence went back: the engine restarted")
        self._drop_all(ep)
        ep.expected = None
        ep.held = []
        self._ask_replay(ep, 0)

    def _out(self, ep: EndpointKV, reason: str, why: str, now: float, retry: bool = False) -> None:
        self._note(ep, reason, why)
        ep.reason = reason
        ep.held = []
        ep.replay_from = ep.replay_started = None
        ep.retry_at = now + self.retry_after if retry else None
        self._drop_all(ep)

    def _joined_late(self, ep: EndpointKV, seq: int | None) -> None:
        """The engine's history before `seq` is gone (or was never asked for): follow from
        there. What it cached before is unknown here, as it is to the approximate index of a
        picker that just started; everything stored from now on is exact."""
        ep.stats.late_joins += 1
        if "late" not in ep.logged:
            ep.logged.add("late")
            log.info("KV events: following an engine from the middle of its history",
                     extra={"endpoint": ep.address, "sequence": seq})

    def _note(self, ep: EndpointKV, key: str, why: str) -> None:
        """One log line per endpoint and kind of trouble (the counters count every one)."""
        if key not in ep.logged:
            ep.logged.add(key)
            log.warning("KV events: trouble with an endpoint's publisher",
                        extra={"endpoint": ep.address, "reason": key, "detail": why[:200]})

    def _apply_item(self, ep: EndpointKV, seq: int, item, now: float,
                    wall_now: float | None) -> bool:
        try:
            batch = item if isinstance(item, EventBatch) else decode_payload(item)
            self._apply(ep, batch, wall_now)
        except KVEventsError as exc:
            ep.stats.malformed += 1
            self._out(ep, MALFORMED, f"batch {seq}: {exc}", now)
            ep.expected = seq + 1
            return False
        ep.expected = seq + 1
        return True

    def _apply_out_of_sync(self, ep: EndpointKV, seq: int, item, now: float) -> None:
        """Out of sync: only an AllBlocksCleared makes the state known again (empty)."""
        ep.expected = seq + 1
        try:
            batch = item if isinstance(item, EventBatch) else decode_payload(item)
        except KVEventsError:
            ep.stats.malformed += 1
            return
        for i, ev in enumerate(batch.events):
            if isinstance(ev, AllBlocksCleared):
                ep.reason, ep.retry_at = "", None
                self._full(ep)
                try:
                    self._apply(ep, EventBatch(batch.ts, batch.events[i:],
                                               batch.data_parallel_rank, batch.unknown), None)
                except KVEventsError as exc:
                    ep.stats.malformed += 1
                    self._out(ep, MALFORMED, f"batch {seq}: {exc}", now)
                return
        ep.stats.dropped += 1

    def _apply(self, ep: EndpointKV, batch: EventBatch, wall_now: float | None) -> None:
        """Apply one batch; KVEventsError on a malformed event, before anything changed."""
        staged = []
        for ev in batch.events:  # check (and hash) first, so a bad batch changes nothing
            if isinstance(ev, BlockStored):
                if ev.medium in (None, "GPU") and ev.group_idx in (None, 0):
                    staged.append((ev, self._check_stored(ep, ev)))
            elif isinstance(ev, BlockRemoved):
                if ev.medium in (None, "GPU") and ev.group_idx in (None, 0):
                    staged.append((ev, None))
            else:
                staged.append((ev, None))
        st = ep.stats
        st.batches += 1
        st.events += len(batch.events)
        st.unknown += batch.unknown
        ep.batches_since_scrape += 1
        if ep.silent:
            ep.silent = False
            self._full(ep)
        if wall_now is not None:
            st.lag = max(0.0, wall_now - batch.ts)
        blocks = ep.blocks
        p = self._changes(ep)
        changes = p.changes
        for ev, tokens in staged:
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                if bs != ep.block_size:
                    ep.block_size = bs
                parent = ev.parent_block_hash
                seed = root_seed(ev.lora_name, ev.lora_id) if parent is None else blocks.get(parent)
                if seed is None:  # its parent is not held here any more: not matchable
                    continue
                own = chain_hashes(tokens, bs, seed, extra=ev.extra_keys)
                for eh, oh in zip(ev.block_hashes, own):
                    blocks.pop(eh, None)  # stored again: now the newest
                    blocks[eh] = oh
                    changes[oh] = True
            elif isinstance(ev, BlockRemoved):
                for eh in ev.block_hashes:
                    oh = blocks.pop(eh, None)
                    if oh is not None:
                        changes[oh] = False
            else:  # AllBlocksCleared
                for oh in blocks.values():
                    changes[oh] = False
                blocks.clear()
        over = len(blocks) - ep.capacity
        if over > 0:  # more than the engine can hold: removals were missed; the oldest go
            st.overflow += over
            self._note(ep, "overflow", f"{len(blocks)} blocks tracked, capacity {ep.capacity}")
            for eh in list(itertools.islice(blocks, over)):
                changes[blocks.pop(eh)] = False

    def _check_stored(self, ep: EndpointKV, ev: BlockStored) -> array:
        """The block's token ids as uint32, after checking the event's shape."""
        bs, n = ev.block_size, len(ev.block_hashes)
        if bs <= 0 or len(ev.token_ids) != n * bs:
            raise KVEventsError(f"BlockStored with {n} hashes, block_size {bs} and "
                                f"{len(ev.token_ids)} token ids")
        if ep.block_size not in (None, bs) and ep.blocks:
            raise KVEventsError(f"block_size changed from {ep.block_size} to {bs}")
        if ev.extra_keys is not None and len(ev.extra_keys) != n:
            raise KVEventsError(f"{len(ev.extra_keys)} extra keys for {n} blocks")
        try:
            return array("I", ev.token_ids)
        except OverflowError:
            raise KVEventsError("token ids out of range") from None

    def _changes(self, ep: EndpointKV) -> _Pending:
        p = self._pending.get(ep.address)
        if p is None:
            p = self._pending[ep.address] = _Pending()
        return p

    def _full(self, ep: EndpointKV) -> None:
        """The endpoint came into sync (or stopped being silent): the workers get every block
        it holds; out of sync (or silent): they drop every block."""
        changes = self._changes(ep).changes
        present = ep.in_sync
        for oh in ep.blocks.values():
            changes[oh] = present

    def _drop_all(self, ep: EndpointKV, keep: bool = False) -> None:
        """The workers drop every block of the endpoint; unless `keep`, so does the tracker
        (a gap keeps them: the replay continues from them)."""
        changes = self._changes(ep).changes
        for oh in ep.blocks.values():
            changes[oh] = False
        if not keep:
            ep.blocks = {}
