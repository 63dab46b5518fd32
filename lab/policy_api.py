"""What a lab routing policy sees and implements (the data types every lab module shares).

A policy sees the gateway's view of the pool: the endpoints, the requests the gateway has in
flight to each (`LabEndpoint.inflight`), and the request (oracles see the engines themselves,
exact whenever the lab calls them; see next_wakeup for the one exception). The lab calls, in
virtual time:

    policy.start(endpoints, clock, rng)      # once, before the first request
    policy.pick(request) -> LabEndpoint      # when a request is sent
    policy.on_done(request, endpoint)        # when its last token was delivered

Policies that read the engines' /metrics (the picker) set `scrape_interval`: the lab then
records each engine's state for their scrapes (`LabEndpoint.history`); see lab/picker_policy.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from local.sim.engine import Engine


@dataclass(eq=False)
class LabEndpoint:
    index: int
    address: str                       # "127.0.0.1:8101"-style name, as the picker sees it
    engine: Engine
    model_name: str = "qwq"
    inflight: int = 0                  # gateway-side count of requests sent and not finished
    busy: bool = False                 # an engine step is scheduled or running
    step_end: float = 0.0              # when the running step's tokens are delivered
    up: bool = True                    # False while the group is down (an outage)
    epoch: int = 0                     # bumps when the group restarts (stale steps are dropped)
    history: list = field(default_factory=list)   # (time, running, waiting, kv_usage) snapshots
    kv_seq: int = 0                    # sequence number of the engine's next KV-event batch


@dataclass(eq=False)
class LabRequest:
    index: int
    request_id: str
    prompt: str
    token_ids: list
    hashes: list
    max_tokens: int                    # the true output length (the engine stops there)
    group: str = ""
    arrival: Optional[float] = None    # send time from a trace (None: the run's arrival process)
    path: str = "/v1/completions"
    endpoint: Optional[LabEndpoint] = None
    router_id: Optional[str] = None    # the picker's request id, for on_request_done
    features: str = ""                 # the picker's predictor key for it (Decision.features)
    max_tokens_cap: Optional[int] = None  # what the client sends as max_tokens (None: the length)
    client: str = ""                   # the edge's x-client-id ("" = none)
    objective: Optional[str] = None    # x-gateway-inference-objective (None = none)
    cap: Optional[int] = None          # the request's own max_tokens cap (PromptSpec.cap)
    extra: Optional[dict] = None       # more body fields (PromptSpec.extra)
    length_class: str = ""             # hidden: the class its length was drawn from
    length_dist: Optional[tuple] = None  # hidden: that class's distribution (loadtest/lengths.py)
    # What the lab saw of it (set before the policy's on_done): times and tokens, as Envoy's
    # access log reports them to the picker.
    sent_at: float = 0.0
    first_token_at: Optional[float] = None
    completion_tokens: int = 0

    def headers(self) -> dict:
        """The request headers the picker sees (what Envoy forwards to it)."""
        out = {"content-type": "application/json"}
        if self.client:
            out["x-client-id"] = self.client
        if self.objective:
            out["x-gateway-inference-objective"] = self.objective
        return out

    def body(self, model: str) -> dict:
        """The client's body. With a cap (the request's own, else the run's), `max_tokens` is the
        cap and the model stops earlier, at its own end of sequence (the true length); without
        one, the true length + ignore_eos, as vLLM's benchmark sends it."""
        cap = self.cap if self.cap is not None else self.max_tokens_cap
        body = {"model": model, "prompt": self.prompt, "stream": True,
                "stream_options": {"include_usage": True}}
        if cap is not None:
            body["max_tokens"] = max(cap, self.max_tokens)
        else:
            body["max_tokens"] = self.max_tokens
            body["ignore_eos"] = True
        if self.extra:
            body.update(self.extra)
        return body


class Deferred(Exception):
    """The policy holds the request (late binding): it hands it out later from `wake()`. The
    client's clock runs from the send, so the hold counts in TTFT."""


class Rejected(Exception):
    """The policy refuses the request (e.g. the picker's 429/503); the lab counts it failed."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status


class Policy:
    name = "policy"
    scrape_interval: Optional[float] = None    # seconds; None = does not scrape
    kv_events: bool = False                    # True: the engines record KV-cache events for it
    # False: the policy never reads the engines' requests (the picker reads only its scrapes),
    # so the lab need not bring them up to date before calling it (lab.simulation._policy).
    reads_engines: bool = True

    def start(self, endpoints: list[LabEndpoint], clock: Callable[[], float],
              rng: random.Random) -> None:
        self.endpoints = endpoints
        self.clock = clock
        self.rng = rng

    def pick(self, request: LabRequest) -> LabEndpoint:
        raise NotImplementedError

    def set_available(self, endpoints: list[LabEndpoint]) -> None:
        """The pool changed (a group went down or came back): pick only among `endpoints`, as
        the gateway does once service discovery drops or re-adds the endpoint."""
        self.endpoints = endpoints

    def on_done(self, request: LabRequest, endpoint: LabEndpoint) -> None:
        pass

    def on_kv_events(self, endpoint: LabEndpoint, seq: int, events: list, at: float) -> None:
        """One batch of an engine's KV-cache events (local.sim.engine's BlockStored,
        BlockRemoved, AllBlocksCleared), published at `at` with sequence number `seq` (from 0
        at every engine start, as vLLM numbers them). Only called when `kv_events` is True; the
        policy models its own delivery delay. Called at every step, not synced (as next_wakeup)."""

    def report(self) -> dict:
        """Figures of the policy's own to add to the run's summary (e.g. the picker's forecast
        accuracy), computed after the run."""
        return {}

    # Late binding: a policy whose pick() raises Deferred answers these.
    def next_wakeup(self) -> Optional[float]:
        """When held requests may go (virtual time), None if nothing is held. Called after every
        event while requests are held, so cheaply: unlike the other calls, without bringing the
        engines' requests up to date (their token counts may lag by the steps of a stretch of
        decode steps, local.sim.engine); read the endpoints' fields (busy, step_end, inflight)
        and the engines' queues, blocks and cache, not the requests' progress."""
        return None

    def wake(self) -> list:
        """Held requests that go now: (request, LabEndpoint | Rejected) pairs."""
        return []
