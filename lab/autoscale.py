"""Groups that follow the load, in virtual time: the routing lab's engines plus the chain
Prometheus scrape -> KEDA/HPA sync -> LeaderWorkerSet replicas -> a group that starts after a
delay, or drains and stops.

What is modelled, and from where:
- the signal is components/autoscaling's: requests in flight on the leaders (vLLM's running +
  waiting), summed over every group that still has a pod (serving or draining), as Prometheus
  scraped it last (every `scrape_s`);
- every `sync_s` the HPA (k8s.io/kubernetes pkg/controller/podautoscaler, AverageValue of an
  External metric) asks for ceil(signal / target) groups, keeps the current count within its
  10 % tolerance, stabilizes (scale-up: the lowest recommendation of its window; scale-down: the
  highest), limits the change per period (`Pods` policies) and clamps to min..max;
- a new group serves `startup_s` after the HPA raised the count (nodes, image, weights, Ray: the
  arithmetic is in lab/README.md) and is billed from that moment;
- a removed group (the highest index, as the LeaderWorkerSet removes) stops receiving requests at
  once (the picker drops terminating leaders), finishes what it holds, and is billed until then.

ScalerSettings.from_scaled_object reads the shipped ScaledObject, so the lab runs the settings the
cluster gets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml

from lab.simulation import _ARRIVAL, _DOWN, _UP, Lab, LabConfig
from local.sim.engine import Engine

_SCRAPE, _SYNC, _READY = 10, 11, 12
SCALED_OBJECT = Path(__file__).resolve().parents[1] / "components" / "autoscaling" / "scaledobject.yaml"
HPA_TOLERANCE = 0.1          # kube-controller-manager --horizontal-pod-autoscaler-tolerance
STARTUP_S = 600.0            # a 2-node A10 group with QwQ-32B from OSS: lab/README.md


@dataclass(frozen=True)
class Policy:
    value: int
    period_s: float


@dataclass(frozen=True)
class ScalerSettings:
    min_groups: int
    max_groups: int
    target: float                         # requests in flight per group (AverageValue)
    up_window_s: float = 0.0
    down_window_s: float = 300.0
    up_policies: tuple = (Policy(4, 15),)         # the HPA's defaults
    down_policies: tuple = (Policy(100, 15),)
    up_select: str = "Max"
    down_select: str = "Max"
    sync_s: float = 15.0                  # the HPA's sync period (it asks KEDA's metrics API then;
                                          # pollingInterval only drives KEDA's own 0<->1 loop)
    scrape_s: float = 15.0                # Prometheus scrape interval

    @classmethod
    def from_scaled_object(cls, path: Path = SCALED_OBJECT, **overrides) -> "ScalerSettings":
        so = yaml.safe_load(Path(path).read_text())
        spec = so["spec"]
        behavior = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior") or {}
        up, down = behavior.get("scaleUp") or {}, behavior.get("scaleDown") or {}

        def policies(rules, default):
            return tuple(Policy(int(p["value"]), float(p["periodSeconds"])) for p in rules.get("policies") or []
                         if p["type"] == "Pods") or default
        trigger = next(t for t in spec["triggers"] if t["type"] == "prometheus")
        settings = dict(
            min_groups=int(spec.get("minReplicaCount", 0)), max_groups=int(spec.get("maxReplicaCount", 100)),
            target=float(trigger["metadata"]["threshold"]),
            up_window_s=float(up.get("stabilizationWindowSeconds", 0)),
            down_window_s=float(down.get("stabilizationWindowSeconds", 300)),
            up_policies=policies(up, (Policy(4, 15),)), down_policies=policies(down, (Policy(100, 15),)),
            up_select=up.get("selectPolicy", "Max"), down_select=down.get("selectPolicy", "Max"))
        settings.update(overrides)
        return cls(**settings)


@dataclass
class Hpa:
    """The HPA's replica computation with behaviors, fed the signal by the lab."""
    settings: ScalerSettings
    recommendations: list = field(default_factory=list)   # (t, desired)
    events: list = field(default_factory=list)            # (t, change): + up, - down

    def desired(self, now: float, signal: float, current: int) -> int:
        s = self.settings
        ratio = signal / (s.target * current) if current else math.inf
        raw = current if abs(ratio - 1.0) <= HPA_TOLERANCE else math.ceil(signal / s.target)
        self.recommendations.append((now, raw))
        keep = max(s.up_window_s, s.down_window_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - keep]
        up = min([r for t, r in self.recommendations if t > now - s.up_window_s] + [raw])
        down = max([r for t, r in self.recommendations if t > now - s.down_window_s] + [raw])
        want = min(max(current, up), down)
        if want > current:
            limits = [current - self._changed(now, p.period_s, +1) + p.value for p in s.up_policies]
            want = min(want, max(limits) if s.up_select == "Max" else min(limits))
        elif want < current:
            limits = [current + self._changed(now, p.period_s, -1) - p.value for p in s.down_policies]
            want = max(want, min(limits) if s.down_select == "Max" else max(limits))
        want = min(max(want, s.min_groups), s.max_groups)
        if want != current:
            self.events.append((now, want - current))
        return want

    def _changed(self, now: float, period: float, sign: int) -> int:
        return sum(abs(c) for t, c in self.events if t > now - period and (c > 0) == (sign > 0))


class ScalingLab(Lab):
    """The lab with a group count that follows `scaler`, or a fixed count (scaler None)."""

    def __init__(self, requests, policy, config: LabConfig, scaler: Optional[ScalerSettings],
                 initial_groups: int, startup_s: float = STARTUP_S):
        super().__init__(requests, policy, config)
        self.scaler, self.startup_s = scaler, startup_s
        self.hpa = Hpa(scaler) if scaler else None
        self.state = ["off"] * len(self.endpoints)      # off | starting | serving | draining
        self.billed_since = [None] * len(self.endpoints)
        self.group_seconds = 0.0
        self.signal = 0.0
        self.timeline: list = []                       # (t, replicas, serving, signal)
        for ep in self.endpoints[:initial_groups]:
            self.state[ep.index], self.billed_since[ep.index] = "serving", 0.0
        for ep in self.endpoints[initial_groups:]:
            ep.up = False

    # ----- groups --------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        return sum(s in ("starting", "serving") for s in self.state)

    def _available(self) -> None:
        self._policy().set_available([ep for ep in self.endpoints if self.state[ep.index] == "serving"])

    def _stop_billing(self, ep) -> None:
        self.group_seconds += self.now - self.billed_since[ep.index]
        self.billed_since[ep.index] = None

    def _scale_to(self, want: int) -> None:
        while self.replicas < want:
            # A draining group's pods are still terminating, so the new group is another engine
            # (the lab holds twice the maximum) that starts at once: slightly optimistic.
            ep = next(e for e in self.endpoints if self.state[e.index] == "off")
            self.state[ep.index], self.billed_since[ep.index] = "starting", self.now
            ep.epoch += 1
            self._push(self.now + self.startup_s, _READY, (ep, ep.epoch))
        while self.replicas > want:        # the LeaderWorkerSet removes the highest group index
            ep = max((e for e in self.endpoints if self.state[e.index] in ("starting", "serving")),
                     key=lambda e: e.index)
            if self.state[ep.index] == "starting" or ep.inflight == 0:
                self.state[ep.index], ep.up = "off", False
                self._stop_billing(ep)
            else:
                self.state[ep.index] = "draining"
        self._available()

    def _ready(self, ep, epoch: int) -> None:
        if self.state[ep.index] != "starting" or epoch != ep.epoch:
            return                              # removed while it was starting
        ep.engine = Engine(ep.engine.engine_model, self.clock, stream=False, decode_runs=True)
        ep.history.clear()
        ep.up, self.state[ep.index] = True, "serving"
        self._available()
        self._send_pending()

    def _finish(self, client, ep) -> None:
        super()._finish(client, ep)
        if self.state[ep.index] == "draining" and ep.inflight == 0:
            self.state[ep.index], ep.up = "off", False
            self._stop_billing(ep)

    def _scrape(self) -> None:
        self.signal = float(sum(len(ep.engine.running) + len(ep.engine.waiting) for ep in self.endpoints
                                if self.state[ep.index] in ("serving", "draining")))

    def _sync(self) -> None:
        want = self.hpa.desired(self.now, self.signal, self.replicas)
        if want != self.replicas:
            self._scale_to(want)
        self.timeline.append((self.now, self.replicas,
                              sum(s == "serving" for s in self.state), self.signal))

    # ----- the lab's event loop, with the scaler's events ----------------------------------

    def _schedule(self) -> None:
        self.policy.start(self.endpoints, lambda: self.now, self.rng)
        self._available()
        for req, t in zip(self.requests, self._arrival_times()):
            self._push(t, _ARRIVAL, req)
        if self.hpa:       # each tick schedules the next while requests are outstanding
            self._push(1e-6, _SCRAPE, None)
            self._push(2e-6, _SYNC, None)

    def _handle(self, kind: int, obj) -> None:
        if kind == _SCRAPE:
            self._scrape()
            if not self._done():
                self._push(self.now + self.scaler.scrape_s, _SCRAPE, None)
        elif kind == _SYNC:
            self._sync()
            if not self._done():
                self._push(self.now + self.scaler.sync_s, _SYNC, None)
        elif kind == _READY:
            self._ready(*obj)
        elif kind in (_DOWN, _UP):
            raise ValueError("outages are not modelled with scaling")
        else:
            super()._handle(kind, obj)

    def _result(self):
        for ep in self.endpoints:
            if self.billed_since[ep.index] is not None:
                self._stop_billing(ep)
        run = super()._result()
        run.summary.update(group_hours=self.group_seconds / 3600.0)
        return run

    def _done(self) -> bool:
        return len(self.samples) == len(self.requests)

    def _can_send(self) -> bool:
        # Open loop (a trace); a request that arrives when no group serves waits in the client.
        return super()._can_send() and any(s == "serving" for s in self.state)


def slo_figures(samples: Sequence, slo_s: float) -> dict:
    """P90 TTFT over the successful requests and the share of all requests (failed = missed) whose
    TTFT was within `slo_s`."""
    ttfts = sorted(s.ttft for s in samples if s.success)
    p90 = ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)] if ttfts else math.inf
    met = sum(1 for s in samples if s.success and s.ttft <= slo_s)
    return {"p90_ttft_s": p90, "slo_attainment_pct": 100.0 * met / len(samples) if samples else 0.0,
            "failed": sum(1 for s in samples if not s.success)}
