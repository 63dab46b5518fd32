"""Canary split (overlays/a10-canary-open-gateway rendered by the launcher: one extra simulated group serving
`qwq-canary qwq`, the HTTPRoute backendRef weights on the gateway, the InferenceModelRewrite
weights in the picker), in both request-body modes.

The share is read from components/canary/split.yaml. Tolerance: with N requests and a share p
the count is binomial, sd = sqrt(N p (1 - p)); the tests accept p +- 3.5 sd (10 % of 300: +- 6 %)."""

from __future__ import annotations

import asyncio
import math

import pytest

from local.stack.config import REPO
from tests.e2e.conftest import completion, start_stack, successes
from validation.canary import split_weights

pytestmark = pytest.mark.e2e

N = 300
SPLIT = split_weights(REPO)
SHARE = SPLIT["canaryWeight"] / (SPLIT["stableWeight"] + SPLIT["canaryWeight"])
TOLERANCE = 3.5 * math.sqrt(SHARE * (1 - SHARE) / N)


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def stack(request, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("canary"), f"canary-{request.param}", canary=True,
                    body_mode=request.param)
    yield s
    s.stop()


def canary(stack):
    sims = [s for s in stack.topology.sims if "qwq-canary" in s.served_model_names]
    assert len(sims) == 1 and sims[0].served_model_names == ["qwq-canary", "qwq"]
    return sims[0]


async def send_all(session, stack, port: int) -> tuple[list[tuple[int, str]], dict[str, float]]:
    """N small requests, 20 at a time: [(status, model in the response)] and, per simulator, how
    many requests it completed meanwhile (its own counter)."""
    sem = asyncio.Semaphore(20)
    before = {s.address: await successes(session, s.address) for s in stack.topology.sims}

    async def one(i):
        async with sem:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json=completion(prompt=f"canary check {i}", max_tokens=1)) as r:
                data = await r.json()
                return r.status, data.get("model")
    results = await asyncio.gather(*(one(i) for i in range(N)))
    served = {a: await successes(session, a) - n for a, n in before.items()}
    return results, served


async def test_8080_splits_by_backend_weights(stack, session):
    weights = {name: w for name, w, _ in stack.topology.http_route}
    assert weights == {"qwq-dist-v1": SPLIT["stableWeight"], "qwq-dist-v2": SPLIT["canaryWeight"]}
    results, served = await send_all(session, stack, stack.http_port)
    assert all(status == 200 for status, _ in results)
    assert sum(served.values()) == N
    share = served[canary(stack).address] / N
    assert abs(share - SHARE) <= TOLERANCE, share


async def test_8081_splits_by_model_rewrite_weights(stack, session):
    """The picker rewrites `qwq` to `qwq-canary` for the canary share of requests and only the canary group
    serves that name; every request must succeed."""
    # Envoy draws a weighted backendRef's Service before applying the endpoint override, so
    # this only works with one 8081 backendRef selecting every leader (overlays/a10-canary*).
    assert len(stack.topology.llm_route) == 1
    results, served = await send_all(session, stack, stack.llm_port)
    statuses = [status for status, _ in results]
    assert statuses.count(200) == N, {s: statuses.count(s) for s in set(statuses)}
    rewritten = sum(model == "qwq-canary" for _, model in results)
    assert abs(rewritten / N - SHARE) <= TOLERANCE, rewritten / N
    # only the canary group serves `qwq-canary`; it may also serve some plain `qwq` requests
    assert served[canary(stack).address] >= rewritten
