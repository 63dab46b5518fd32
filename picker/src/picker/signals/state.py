"""Per-endpoint load state: the last scrape, its age, and requests sent but not yet finished; the
in-flight counts as shared with peers (`Load`, `merge_loads`) and what a Router keeps for them
(`PeerSync`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from picker.signals.metrics import ModelServerMetrics


@dataclass(slots=True, eq=False)
class EndpointState:
    address: str
    metrics: ModelServerMetrics | None = None
    scraped_at: float | None = None   # clock time of the last successful scrape
    failing: bool = False             # out until a scrape succeeds (see Router.on_scrape_failed)
    scrape_errors: int = 0
    failures_in_a_row: int = 0        # consecutive failed scrapes
    # In-flight counts: requests sent and not yet finished, by this process and (peer_*) by the
    # other workers and replicas sharing this pool's view; the totals include the peers'.
    inflight: int = 0                 # sent, not yet finished
    inflight_tokens: int = 0          # their approximate prompt tokens
    since_scrape: int = 0             # of those, sent after the last scrape (not in its numbers)
    since_scrape_tokens: int = 0
    peer_inflight: int = 0
    peer_inflight_tokens: int = 0
    peer_since_scrape: int = 0
    peer_since_scrape_tokens: int = 0
    stale: bool = False               # set per decision: metrics older than the staleness bound
    epoch: int = 0                    # number of successful scrapes, to date in-flight entries
    listed_models: frozenset[str] = frozenset()  # ids in its /v1/models: base names and adapters

    @property
    def ready(self) -> bool:
        """Has answered a scrape and the last one did not fail."""
        return self.metrics is not None and not self.failing

    def serves(self, model: str) -> bool:
        """Served names from the metrics, running or waiting adapters, or any model or adapter
        the server lists in /v1/models (an idle adapter appears only there)."""
        m = self.metrics
        return m is not None and (model in m.models or model in self.listed_models
                                  or model in m.lora_running or model in m.lora_waiting)


@dataclass(slots=True)
class InflightEntry:
    state: EndpointState
    sent_at: float
    tokens: int
    epoch: int  # state.epoch when sent; equal to the current one => counted in since_scrape


def add_inflight(state: EndpointState, tokens: int, now: float) -> InflightEntry:
    state.inflight += 1
    state.inflight_tokens += tokens
    state.since_scrape += 1
    state.since_scrape_tokens += tokens
    return InflightEntry(state, now, tokens, state.epoch)


def end_inflight(entry: InflightEntry) -> None:
    """A request ended. It stays in since_scrape until the next scrape: the deployed Envoy config
    sends the picker only the request phase, so Envoy closes the stream as soon as the picker has
    answered, long before the server's metrics show the request; dropping it from since_scrape
    then would let a burst between two scrapes pile onto one endpoint."""
    state = entry.state
    state.inflight = max(state.peer_inflight, state.inflight - 1)
    state.inflight_tokens = max(state.peer_inflight_tokens, state.inflight_tokens - entry.tokens)


def record_scrape(state: EndpointState, metrics: ModelServerMetrics, now: float) -> None:
    """Store a scrape; requests sent before it are now part of the server's own numbers."""
    state.metrics = metrics
    state.scraped_at = now
    state.failing = False
    state.failures_in_a_row = 0
    state.epoch += 1
    state.since_scrape = state.peer_since_scrape
    state.since_scrape_tokens = state.peer_since_scrape_tokens


Load = tuple[int, int, int, int]  # inflight, inflight_tokens, since_scrape, since_scrape_tokens
ZERO_LOAD: Load = (0, 0, 0, 0)


def merge_loads(tables: Iterable[Mapping[str, Load]],
                addresses: Iterable[str] | None = None) -> dict[str, Load]:
    """Per endpoint, the sum of the tables' loads: of every endpoint a table names, or of exactly
    `addresses` (ZERO_LOAD where no table has one). The one place loads are added up: the
    signals process (workers and replicas), the peer store and the lab's replicas use it."""
    tables = list(tables)
    if addresses is None:
        addresses = dict.fromkeys(a for table in tables for a in table)
    total = {}
    for addr in addresses:
        t = ZERO_LOAD
        for table in tables:
            load = table.get(addr)
            if load is not None:
                t = (t[0] + load[0], t[1] + load[1], t[2] + load[2], t[3] + load[3])
        total[addr] = t
    return total


def subtract_load(total: Load, part: Load) -> Load:
    """total - part, field by field (the others' share of a sum that includes part)."""
    return (total[0] - part[0], total[1] - part[1], total[2] - part[2], total[3] - part[3])


@dataclass(slots=True, eq=False)
class PeerSync:
    """What a Router keeps for the peers that share its view (other workers and replicas), owned
    by the Router (`Router.share_with_peers`): the prefix-index additions of its decisions, the
    endpoints whose own in-flight counts changed since the last `take_changed_loads`, and a
    callback at the first such change (workers.py flushes them within the loop iteration)."""
    prefix_log: list[tuple[str, list[int], int | None]] = field(default_factory=list)
    changed: set[str] = field(default_factory=set)
    on_change: Callable[[], None] | None = None


def own_load(state: EndpointState) -> Load:
    """This process's share of the in-flight counts (what it tells its peers)."""
    return (state.inflight - state.peer_inflight,
            state.inflight_tokens - state.peer_inflight_tokens,
            state.since_scrape - state.peer_since_scrape,
            state.since_scrape_tokens - state.peer_since_scrape_tokens)


def set_peer_load(state: EndpointState, load: Load) -> None:
    """Replace the peers' share of the in-flight counts (the sum over every peer)."""
    inflight, tokens, since, since_tokens = load
    state.inflight += inflight - state.peer_inflight
    state.inflight_tokens += tokens - state.peer_inflight_tokens
    state.since_scrape += since - state.peer_since_scrape
    state.since_scrape_tokens += since_tokens - state.peer_since_scrape_tokens
    state.peer_inflight, state.peer_inflight_tokens = inflight, tokens
    state.peer_since_scrape, state.peer_since_scrape_tokens = since, since_tokens
