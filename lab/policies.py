"""Routing policies for the lab.

A policy sees the gateway's view of the pool: the endpoints, the requests the gateway has in
flight to each (`LabEndpoint.inflight`), and the request. The lab calls, in virtual time:

    policy.start(endpoints, clock, rng)      # once, before the first request
    policy.pick(request) -> LabEndpoint      # when a request is sent
    policy.on_done(request, endpoint)        # when its last token was delivered

Policies that read the engines' /metrics (the picker) override `scrape_interval` and
`on_router_call`; see lab/picker_policy.py.
"""

from __future__ import annotations

import random
import re
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
    history: list = field(default_factory=list)   # (time, running, waiting, kv_usage) snapshots


@dataclass(eq=False)
class LabRequest:
    index: int
    request_id: str
    prompt: str
    token_ids: list
    hashes: list
    max_tokens: int
    group: str = ""
    path: str = "/v1/completions"
    endpoint: Optional[LabEndpoint] = None
    router_id: Optional[str] = None    # the picker's request id, for on_request_done

    def body(self, model: str) -> dict:
        return {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}


class Rejected(Exception):
    """The policy refuses the request (e.g. the picker's 429/503); the lab counts it failed."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status = status


class Policy:
    name = "policy"
    scrape_interval: Optional[float] = None    # seconds; None = does not scrape

    def start(self, endpoints: list[LabEndpoint], clock: Callable[[], float],
              rng: random.Random) -> None:
        self.endpoints = endpoints
        self.clock = clock
        self.rng = rng

    def pick(self, request: LabRequest) -> LabEndpoint:
        raise NotImplementedError

    def on_done(self, request: LabRequest, endpoint: LabEndpoint) -> None:
        pass


class RoundRobin(Policy):
    name = "round-robin"

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.next = 0

    def pick(self, request):
        ep = self.endpoints[self.next % len(self.endpoints)]
        self.next += 1
        return ep


class RandomChoice(Policy):
    name = "random"

    def pick(self, request):
        return self.rng.choice(self.endpoints)


class LeastRequest(Policy):
    """Envoy's least request with `choice_count` 2 for equal weights: draw two hosts at random
    (with replacement) and keep the one with fewer active requests; a tie keeps the first draw
    (envoy source/extensions/load_balancing_policies/least_request)."""

    name = "least-request"

    def __init__(self, choice_count: int = 2):
        self.choice_count = choice_count

    def pick(self, request):
        eps, rng = self.endpoints, self.rng
        best = None
        for _ in range(self.choice_count):
            ep = eps[rng.randrange(len(eps))]
            if best is None or ep.inflight < best.inflight:
                best = ep
        return best


BASIC_POLICIES = {p.name: p for p in (RoundRobin, RandomChoice, LeastRequest)}


def file_name(policy: str) -> str:
    """A policy name made safe for a file name: `picker:/x/my.yaml` -> `picker_x_my.yaml`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", policy)


def make_policy(name: str, **options) -> Policy:
    """A policy by name: round-robin, random, least-request, picker[:PROFILE] (PROFILE = a
    picker profile name or YAML path, default `default`; `picker-upstream` = upstream-default)."""
    if name in BASIC_POLICIES:
        return BASIC_POLICIES[name]()
    if name == "picker-upstream":
        name = "picker:upstream-default"
    if name == "picker" or name.startswith("picker:"):
        from lab.picker_policy import PickerPolicy
        profile = name.partition(":")[2] or "default"
        return PickerPolicy(profile, **options)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(BASIC_POLICIES)}, "
                     f"picker[:PROFILE], picker-upstream")
