"""Abuse and soak: the picker as its own process, hit by hostile traffic in repeated rounds while
a well-behaved client measures its decision latency.

Each round sends requests with distinct unknown model names, forged x-request-ids (the picker's
own form) on streams cut right after the decision, a burst of large unfinished bodies in both
body modes (more than the body budget), 1 MiB model names and repeated request_headers. After
every round: the process's RSS, the number of series and bytes of its /metrics page, and the
median round trip of a good client's requests. Memory and series must stay flat from round to
round, the in-flight counts must return to zero, and the good client's latency after the abuse
must match its latency before (ratios within this run; the machine is shared and noisy).

`make test` runs two short rounds. The soak: PICKER_SOAK_SECONDS=180 pytest -s -m soak ...
runs rounds for that long and prints the figures.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import pytest

from tests.helpers import extproc_client as c
from helpers import FakeVllm, body, free_ports, metrics_text

SOAK_SECONDS = float(os.environ.get("PICKER_SOAK_SECONDS", "0"))
MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]
UNKNOWN_PER_ROUND = 1500
FORGED_PER_ROUND = 300
BIG_BODIES = 24          # x 2 MiB, against a 16 MiB body budget
GOOD_SAMPLES = 150

pytestmark = pytest.mark.soak


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Picker:
    def __init__(self, endpoints, log_path: Path):
        self.grpc_port, self.health_port, self.metrics_port = free_ports(3)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "picker", "--discovery", "static", "--endpoints", ",".join(endpoints),
             "--no-secure-serving", "--bind", "127.0.0.1", "--grpc-port", str(self.grpc_port),
             "--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port), "--outcomes-port", "0",
             "--max-body-bytes", str(4 * MIB), "--max-buffered-bytes", str(16 * MIB),
             "--max-streams", "512"],
            stdout=subprocess.DEVNULL, stderr=self.log,
            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'picker' / 'src'}"})

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def metrics_page(port: int) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
            return await r.text()


def series(page: str) -> int:
    return sum(1 for line in page.splitlines() if line and not line.startswith("#"))


def label_values(page: str, label: str) -> set[str]:
    out = set()
    for line in page.splitlines():
        if not line.startswith("#"):
            out.update(re.findall(rf'[{{,]{label}="([^"]*)"', line))
    return out


def sample(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def good_request(stub) -> float:
    started = time.perf_counter()
    call, answers = await c.send_buffered(stub, c.post_headers(), body(prompt="what is 2+2?"))
    assert answers[-1].HasField("request_body"), answers[-1]
    elapsed = time.perf_counter() - started
    call.cancel()
    return elapsed


async def good_latency(stub, n=GOOD_SAMPLES) -> float:
    return statistics.median([await good_request(stub) for _ in range(n)])


async def unknown_models(stub, round_no: int):
    async def one(i):
        call, answers = await c.send_buffered(
            stub, c.post_headers(), body(model=f"made-up-{round_no}-{i}"))
        assert answers[-1].immediate_response.status.code == 404
    for start in range(0, UNKNOWN_PER_ROUND, 50):
        await asyncio.gather(*(one(i) for i in range(start, start + 50)))


async def forged_ids(stub):
    async def one(i):
        call, answers = await c.send_buffered(
            stub, c.post_headers(**{"x-request-id": f"picker-{i}"}), body())
        assert answers[-1].HasField("request_body")
        call.cancel()  # the client goes away before the response: the stream ends
    for start in range(0, FORGED_PER_ROUND, 50):
        await asyncio.gather(*(one(i) for i in range(start, start + 50)))


async def big_bodies(stub) -> dict[str, int]:
    """Unfinished 2 MiB bodies, half in each body mode: the budget refuses what is over it."""
    outcomes: dict[str, int] = {}
    calls = []

    async def one(i):
        call = stub.Process()
        calls.append(call)
        mode = c.FULL_DUPLEX if i % 2 else c.BUFFERED
        await call.write(c.request_headers(c.post_headers(), mode=mode))
        if mode == c.BUFFERED:
            await call.read()  # the headers answer
        prompt = b"x" * (2 * MIB)
        # BUFFERED sends the body as one message, FULL_DUPLEX in chunks; neither ever ends it
        chunks = [prompt] if mode == c.BUFFERED else [prompt[k:k + 256 * 1024]
                                                      for k in range(0, len(prompt), 256 * 1024)]
        answer = asyncio.create_task(call.read())  # read while writing: a refusal comes early
        try:
            for chunk in chunks:
                await call.write(c.request_body(chunk, False))
        except Exception:
            pass  # the picker already answered and ended the stream
        try:
            resp = await asyncio.wait_for(answer, 2.0)
            key = (str(resp.immediate_response.status.code) if resp.HasField("immediate_response")
                   else "accepted")
        except asyncio.TimeoutError:
            key = "held"  # full duplex: buffered, waiting for the end of the body
        key = f"{'buffered' if mode == c.BUFFERED else 'full-duplex'} {key}"
        outcomes[key] = outcomes.get(key, 0) + 1

    await asyncio.gather(*(one(i) for i in range(BIG_BODIES)))
    for call in calls:
        call.cancel()
    return outcomes


async def long_names_and_repeated_headers(stub):
    for _ in range(5):
        call, answers = await c.send_buffered(stub, c.post_headers(), body(model="m" * MIB))
        assert answers[-1].immediate_response.status.code == 404
    for _ in range(20):
        call = stub.Process()
        get = {":method": "GET", ":path": "/v1/models", ":authority": "gw"}
        await call.write(c.request_headers(get, eos=True, mode=c.BUFFERED))
        await call.read()
        # a stream routes one request: the picker ends it once answered (--end-answered-streams,
        # the default), so a second request_headers has no stream to go on (without that flag
        # it gets 400 protocol_error: test_limits.py)
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


async def abuse_round(stub, round_no: int) -> dict:
    started = time.perf_counter()
    await unknown_models(stub, round_no)
    await forged_ids(stub)
    outcomes = await big_bodies(stub)
    await long_names_and_repeated_headers(stub)
    return {"seconds": time.perf_counter() - started, "big_bodies": outcomes}


async def settled_page(port: int, timeout=5.0) -> str:
    """The /metrics page once no request is in flight (streams the client cut have ended on the
    server), or the last page when in-flight entries never drain (orphaned)."""
    end = time.monotonic() + timeout
    while True:
        page = await metrics_page(port)
        if sample(page, "picker_endpoint_inflight") == 0 or time.monotonic() > end:
            return page
        await asyncio.sleep(0.1)


async def wait_for_picker(stub, deadline=20.0):
    end = time.monotonic() + deadline
    while True:
        try:
            await good_request(stub)
            return
        except (grpc.aio.AioRpcError, AssertionError):
            assert time.monotonic() < end, "the picker never routed a request"
            await asyncio.sleep(0.2)


async def test_abuse_keeps_memory_series_and_good_latency_flat(tmp_path, record_property):
    vllms = [await FakeVllm(metrics_text(waiting=1, running=2, kv=0.2),
                           {"object": "list", "data": [{"id": "qwq"}]}).start() for _ in range(2)]
    picker = Picker([v.address for v in vllms], tmp_path / "picker.log")
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}",
                                   options=[("grpc.max_send_message_length", 64 * MIB)])
    stub = c.ep_stub(ch)
    try:
        await wait_for_picker(stub)
        await good_latency(stub, 50)  # warm-up
        before = await good_latency(stub)
        page = await metrics_page(picker.metrics_port)
        rows = [{"round": 0, "rss_mib": rss_mib(picker.proc.pid), "series": series(page),
                 "page_bytes": len(page), "good_ms": before * 1000}]
        deadline = time.monotonic() + SOAK_SECONDS
        round_no = 0
        while round_no < 2 or time.monotonic() < deadline:
            round_no += 1
            # a good client keeps sending during the round too
            during_task = asyncio.create_task(good_latency(stub, 40))
            info = await abuse_round(stub, round_no)
            during = await during_task
            await asyncio.sleep(0.5)  # streams cut by the client end on the server side
            after = await good_latency(stub)
            page = await settled_page(picker.metrics_port)
            rows.append({"round": round_no, "rss_mib": rss_mib(picker.proc.pid),
                         "series": series(page), "page_bytes": len(page),
                         "models": label_values(page, "model") | label_values(page, "target_model"),
                         "endpoints": label_values(page, "endpoint"),
                         "good_ms": after * 1000, "good_during_ms": during * 1000,
                         "inflight": sample(page, "picker_endpoint_inflight"), **info})
        shown = [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                  if k not in ("models", "endpoints")} for row in rows]
        for row in shown:
            print("abuse", row)
        record_property("rounds", json.dumps(shown))  # `python -m bench soak` reads them
        base, abused = rows[0], rows[1:]
        # series: label values only from a fixed set (the refusal, 404 and, when a scrape of the
        # busy fake server times out, scrape-error series appear once), so the count is flat
        assert all(r["models"] <= {"qwq", "unknown", ""} for r in abused), rows
        assert all(r["endpoints"] <= {v.address for v in vllms} for r in abused), rows
        assert max(r["series"] for r in abused) - base["series"] < 20, rows
        assert max(r["page_bytes"] for r in abused) < 2 * base["page_bytes"], rows
        assert all(r["inflight"] == 0 for r in abused), "in-flight entries were orphaned"
        # memory: bounded by the burst (48 MiB of bodies in flight, 16 MiB of them buffered at
        # most) plus allocator slack, never growing with the number of hostile requests
        rss = [r["rss_mib"] for r in abused]
        assert max(rss) - base["rss_mib"] < 100, rows
        if len(rss) >= 4:
            half = len(rss) // 2
            assert max(rss[half:]) < max(rss[:half]) + 16, rows
        # the body budget refused the burst with 503 instead of buffering it all
        assert all(r["big_bodies"].get("buffered 503", 0) > 0
                   and r["big_bodies"].get("full-duplex 503", 0) > 0 for r in abused), rows
        # a good client's decisions are as fast after the abuse as before it
        assert statistics.median(r["good_ms"] for r in abused) < 2.0 * base["good_ms"] + 1.0, rows
        # the 1 MiB model names were clipped in the log
        longest = max(len(line) for line in (tmp_path / "picker.log").read_bytes().splitlines())
        assert longest < 4096
    finally:
        await ch.close()
        picker.stop()
        for v in vllms:
            await v.stop()
