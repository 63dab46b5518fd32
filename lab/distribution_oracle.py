"""The distribution oracle: the clairvoyant oracle's exact engine state, but only a request's
class and its class's length distribution, not the realised length.

What any length learner could at best know is the distribution an answer is drawn from, given
everything the request shows; no learner knows the draw. This oracle sees every engine's exact
state as lab/oracle.py's does and plays each candidate forward the same way, with every request's
length replaced by what its class's distribution says: a running request that has produced k
tokens ends after its expected residual length given k (loadtest/lengths.py `residual`), the new
request is as long as its class's median. Its distance to the clairvoyant oracle is what the
lengths' randomness costs; the picker's distance to it is what learning and the picker's partial
view of the engines cost.

A request without a class distribution (a trace, ShareGPT) gets the distribution of the answers
finished so far in the run (the pool-wide one, learned as the run goes).
"""

from __future__ import annotations

import math

from loadtest import lengths
from lab.oracle import Oracle, copy_engine, play_to_first_token, ttft_lower_bound, work_left
from lab.policy_api import LabEndpoint, LabRequest


class DistributionOracle(Oracle):
    name = "oracle-dist"

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.requests: dict[str, LabRequest] = {}
        self.finished: list[int] = []          # answer lengths finished so far (the fallback)

    def on_done(self, request, endpoint):
        self.finished.append(request.max_tokens)
        self.requests.pop(request.request_id, None)

    def _residual(self, request: LabRequest | None, produced: int) -> float:
        if request is not None and request.length_dist is not None:
            return lengths.residual(request.length_dist, produced)
        left = [n - produced for n in self.finished if n > produced]
        return sum(left) / len(left) if left else max(1.0, float(produced))

    def _expected(self, request: LabRequest) -> int:
        if request.length_dist is not None:
            return max(1, round(lengths.median(request.length_dist)))
        done = sorted(self.finished)
        return done[len(done) // 2] if done else request.max_tokens_cap or 256

    def pick(self, request: LabRequest) -> LabEndpoint:
        self.requests[request.request_id] = request
        now = self.clock()
        best, best_key = None, (math.inf, math.inf)
        for ep in sorted(self.endpoints, key=lambda e: (len(e.engine.waiting), e.engine.used)):
            key = self._predicted(ep, request, now, best_key[0])
            if best is None or key < best_key:
                best, best_key = ep, key
        return best

    def _predicted(self, ep: LabEndpoint, request: LabRequest, now: float,
                   limit: float) -> tuple[float, float]:
        """(seconds to the request's first token there, work left there), with every length
        replaced by its distribution's expectation."""
        if limit < math.inf and ttft_lower_bound(ep, request, now) > limit + 1e-6:
            return math.inf, math.inf     # its queue alone takes longer (no length enters it)
        t = [max(now, ep.step_end) if ep.busy else now]
        engine = copy_engine(ep.engine, lambda: t[0])
        room = engine.engine_model.max_model_len
        for r in engine.requests.values():
            left = max(1, round(self._residual(self.requests.get(r.request_id), r.num_output)))
            r.stop_at = r.max_tokens = min(room - r.prompt_len, r.num_output + left)
        own = min(self._expected(request), room - len(request.token_ids))
        try:
            target = engine.add_request(request.request_id, request.token_ids, max(1, own),
                                        hashes=request.hashes)
        except ValueError:
            return math.inf, math.inf
        work = work_left(engine)
        return play_to_first_token(engine, target, t, now, limit), work
