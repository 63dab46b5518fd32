"""The picker as a lab policy: the picker's real Router, fed the engines' rendered /metrics.

Everything production would do, in virtual time:
- every endpoint is scraped every `scrape_interval` seconds (the picker's default,
  `picker.defaults.SCRAPE_INTERVAL`), with the endpoints' scrape phases spread over one
  interval; the page is `local.sim.metrics.render_gauges` of the engine's state at the scrape
  instant and goes through `Router.on_scrape_ok` (the picker's own parser, staleness rules);
- each request is decided by `Router.decide(RequestInfo(path, headers, body))` with the same JSON
  body a load-test client sends, and reported with `Router.on_request_done` when the picker
  would learn of its end: with the deployed EnvoyExtensionPolicy (request phase only) Envoy closes
  the ext_proc stream as soon as the picker has answered, so by default the lab reports the end
  right after the decision (`phases="request"`); `phases="response"` reports it when the response
  completes, as a policy that also sends the response phase would.

Scrapes are replayed lazily: before each Router call the adapter performs, per endpoint, the
latest scrape tick not yet performed, with the engine state recorded at that tick. Only the
latest scrape before a call can influence the Router (each scrape replaces the previous
signals), so this equals scraping at every tick, at a fraction of the cost.
"""

from __future__ import annotations

import bisect
import json
import math
import random

from picker import defaults
from picker.core import RequestInfo, Router, RouterSettings
from picker.errors import PickerError
from picker.scheduling.profile import load_profile

from local.sim.metrics import cache_config_labels, render_gauges
from lab.policy_api import LabRequest, Policy, Rejected

PHASES = ("request", "response")


class PickerPolicy(Policy):
    def __init__(self, profile: str = "default", scrape_interval: float | None = None,
                 staleness: float | None = None, phases: str = "request"):
        if phases not in PHASES:
            raise ValueError(f"phases must be one of {PHASES}, not {phases!r}")
        self.phases = phases
        self.profile_name = profile
        self.name = "picker" if profile == "default" else f"picker:{profile}"
        if phases != "request":
            self.name += f"+{phases}"
        self.profile = load_profile(profile)
        self.scrape_interval = scrape_interval or defaults.SCRAPE_INTERVAL
        self.settings = RouterSettings() if staleness is None else RouterSettings(staleness=staleness)
        self.scrapes = 0

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.router = Router(self.profile, clock=clock, rng=random.Random(rng.random()),
                             settings=self.settings)
        self.router.set_endpoints([ep.address for ep in endpoints])
        self.by_address = {ep.address: ep for ep in endpoints}
        n, iv = len(endpoints), self.scrape_interval
        # Scraping started one interval before the first request, phases spread evenly.
        self.phase = [-iv + i * iv / n for i in range(n)]
        self.done_tick = [-math.inf] * n
        self.cache_config = [cache_config_labels(ep.engine) for ep in endpoints]
        self.texts: dict = {}

    def _catch_up(self) -> None:
        now, iv = self.clock(), self.scrape_interval
        for ep in self.endpoints:
            i = ep.index
            tick = self.phase[i] + math.floor((now - self.phase[i]) / iv) * iv
            if tick <= self.done_tick[i]:
                continue
            hist = ep.history
            j = bisect.bisect_right(hist, tick, key=lambda h: h[0]) - 1
            if j >= 0:
                _, running, waiting, kv = hist[j]
                del hist[:j]
            else:
                running, waiting, kv = 0, 0, 0.0
            key = (ep.model_name, running, waiting, kv)
            text = self.texts.get(key)
            if text is None:
                text = render_gauges(ep.model_name, running, waiting, kv, self.cache_config[i])
                if len(self.texts) > 4096:
                    self.texts.clear()
                self.texts[key] = text
            self.router.on_scrape_ok(ep.address, text, tick)
            self.done_tick[i] = tick
            self.scrapes += 1

    def set_available(self, endpoints):
        super().set_available(endpoints)
        self.router.set_endpoints([ep.address for ep in endpoints])

    def pick(self, request: LabRequest):
        self._catch_up()
        body = json.dumps(request.body(self.endpoints[0].model_name)).encode()
        info = RequestInfo(request.path, {"content-type": "application/json"}, body)
        try:
            decision = self.router.decide(info)
        except PickerError as err:
            raise Rejected(getattr(err, "status", 500), str(err)) from err
        request.router_id = decision.request_id
        if self.phases == "request":  # Envoy closes the stream once the request phase is answered
            self.router.on_request_done(decision.request_id)
        return self.by_address[decision.endpoint]

    def on_done(self, request, endpoint):
        self._catch_up()
        if self.phases == "response" and request.router_id is not None:
            self.router.on_request_done(request.router_id)
