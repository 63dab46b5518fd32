"""Envoy's default balancing, as the 8080 listener and the 8081 fallback need it.

Envoy Gateway's default policy is LeastRequest; with equal host weights Envoy's least-request
balancer draws `choice_count` (2) hosts at random, with replacement, and keeps the one with
fewer active requests (the first drawn on a tie). An HTTPRoute rule with several weighted
backendRefs becomes a weighted-cluster route: Envoy first draws a cluster by weight, then
balances inside it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Endpoint:
    address: str  # "ip:port"
    in_flight: int = 0


class LeastRequest:
    """Power of two choices over in-flight request counts."""

    def __init__(self, endpoints: list[Endpoint], rng: random.Random, choice_count: int = 2):
        if not endpoints:
            raise ValueError("a backend group needs at least one endpoint")
        self.endpoints = endpoints
        self._rng = rng
        self._choice_count = choice_count

    def pick(self) -> Endpoint:
        if len(self.endpoints) == 1:
            return self.endpoints[0]
        best = None
        for _ in range(self._choice_count):
            candidate = self._rng.choice(self.endpoints)
            if best is None or candidate.in_flight < best.in_flight:
                best = candidate
        return best


@dataclass
class BackendGroup:
    name: str
    weight: int
    balancer: LeastRequest

    def lookup(self, address: str) -> Endpoint | None:
        for e in self.balancer.endpoints:
            if e.address == address:
                return e
        return None


@dataclass
class Route:
    """A route's backends: weighted groups, each balanced by least request."""

    groups: list[BackendGroup]
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self):
        if not self.groups:
            raise ValueError("a route needs at least one backend group")
        if any(g.weight < 0 for g in self.groups) or sum(g.weight for g in self.groups) <= 0:
            raise ValueError("backend weights must be >= 0 with a positive sum")
        self.by_address = {e.address: e for g in self.groups for e in g.balancer.endpoints}

    @classmethod
    def build(cls, groups: list[tuple[str, int, list[str]]], seed: int | None = None,
              registry: dict[str, Endpoint] | None = None) -> "Route":
        """Routes built with the same registry share Endpoint objects, hence in-flight counts
        (Envoy counts active requests per host, whichever route sent them)."""
        registry = {} if registry is None else registry
        rng = random.Random(seed)
        built = []
        for name, weight, addresses in groups:
            endpoints = [registry.setdefault(a, Endpoint(a)) for a in addresses]
            built.append(BackendGroup(name, weight, LeastRequest(endpoints, rng)))
        return cls(built, rng)

    def pick_group(self) -> BackendGroup:
        if len(self.groups) == 1:
            return self.groups[0]
        return self.rng.choices(self.groups, weights=[g.weight for g in self.groups])[0]

    def pick(self) -> Endpoint:
        return self.pick_group().balancer.pick()

    def lookup(self, address: str) -> Endpoint | None:
        return self.by_address.get(address)
