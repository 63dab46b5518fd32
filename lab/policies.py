"""The lab's routing policies by name: the basic ones (round robin, random, Envoy's least
request) here, and a registry (`make_policy`) for them and for the oracle (lab/oracle.py), the
picker (lab/picker_policy.py) and picker replicas (lab/replicated_picker.py). The interface a
policy implements is in lab/policy_api.py.
"""

from __future__ import annotations

import re

from lab.policy_api import Policy


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
    picker profile name or YAML path, default `default`; `picker-upstream` = upstream-default).
    A picker or replicas name ending in `+precise` (or `+precise=SECONDS`: the events' delivery
    delay) routes on the engines' KV-cache events (lab/picker_policy.py)."""
    base, plus, precise = name.partition("+precise")
    if plus and (name.startswith(("picker", "replicas:"))) and (not precise or precise.startswith("=")):
        try:
            delay = float(precise[1:]) if precise else None
        except ValueError:
            raise ValueError(f"bad policy {name!r}: +precise=SECONDS") from None
        return make_policy(base, **options, precise=True, kv_delay=delay)
    if name in BASIC_POLICIES:
        return BASIC_POLICIES[name]()
    if name.startswith("replicas:"):
        from lab.replicated_picker import ReplicatedPicker
        return ReplicatedPicker.from_name(name, **options)
    if name == "oracle":
        from lab.oracle import Oracle
        return Oracle()
    if name == "oracle-dist":
        from lab.distribution_oracle import DistributionOracle
        return DistributionOracle()
    if name == "oracle-late":
        from lab.oracle import LateOracle
        return LateOracle()
    if name == "picker-flow-reject":  # --flow-at-bound reject: refused at the age bound
        from lab.picker_policy import PickerPolicy
        from picker.flowcontrol.controller import FlowSettings
        policy = PickerPolicy("default", flow_settings=FlowSettings(at_bound="reject"), **options)
        policy.name = name
        return policy
    if name == "picker-flow" or name.startswith("picker-flow:"):
        from lab.picker_policy import PickerPolicy
        profile = name.partition(":")[2] or "default"
        return PickerPolicy(profile, flow=True, **options)
    if name in ("picker-told-lengths", "picker-told-distributions"):   # analysis: lab/picker_policy.py
        from lab.picker_policy import PickerPolicy
        policy = PickerPolicy("lengths", told=name.rsplit("-", 1)[1].rstrip("s"), **options)
        policy.name = name
        return policy
    if name == "picker-no-lengths":   # the default profile without output-length forecasts
        from lab.picker_policy import PickerPolicy
        policy = PickerPolicy("default", lengths=None, **options)
        policy.name = name
        return policy
    if name == "picker-upstream":
        name = "picker:upstream-default"
    if name == "picker" or name.startswith("picker:"):
        from lab.picker_policy import PickerPolicy
        profile = name.partition(":")[2] or "default"
        return PickerPolicy(profile, **options)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(BASIC_POLICIES)}, oracle, "
                     f"oracle-late, oracle-dist, picker-no-lengths, picker-told-lengths, picker-told-distributions, picker[:PROFILE], picker-flow[:PROFILE], picker-flow-reject, "
                     f"picker-upstream, "
                     f"replicas:N[:independent|:active-passive], each picker or replicas name with +precise[=SECONDS]")
