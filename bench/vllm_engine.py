"""The `vllm` benchmark: real vLLM's CPU build serving the tiny model (local/vllm_server). How
long a server takes to start and how much memory it holds, what a request costs on this CPU, and
the wall time of the suite that holds the simulator to it (tests/conformance, its own server
included). Functional figures of this machine, not A10 ones."""

from __future__ import annotations

import json
import socket
import statistics
import time
import urllib.request
from pathlib import Path

from bench.common import PY, RESULTS, load_average, run, save, stamp
from local import vllm_server

PROMPT_WORDS, MAX_TOKENS, REQUESTS = 300, 16, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (vLLM forks its engine core), MiB."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            pids += [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                     for c in (t / "children").read_text().split()]
        except OSError:
            pass
    return total / 1024


def _completion(address: str, prompt: str) -> float:
    body = json.dumps({"model": "qwq", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == MAX_TOKENS
    return time.monotonic() - started


def run_vllm() -> dict:
    from tests.conformance.exchanges import words
    if not vllm_server.available():
        raise RuntimeError("real vLLM is not installed: run `make vllm` first")
    server = vllm_server.VllmServer(port=_free_port())
    log = RESULTS / "vllm-server.log"
    load_start = load_average()
    started = time.monotonic()
    proc = vllm_server.start(server, log)
    try:
        vllm_server.wait_ready(server, proc, log)
        startup = time.monotonic() - started
        rss = _rss_mib(proc.pid)
        # distinct prompts (no prefix hits), then the first one again (a full prefix hit)
        cold = [_completion(server.address, words(PROMPT_WORDS, 40 * i)) for i in range(REQUESTS)]
        hit = [_completion(server.address, words(PROMPT_WORDS, 0)) for _ in range(REQUESTS)]
    finally:
        vllm_server.stop(proc)
    suite = run([PY, "-m", "pytest", "-q", "tests/conformance"], log=RESULTS / "vllm-conformance.log")
    data = {"version": vllm_server.VERSION, "startup_s": startup, "rss_mib": rss,
            "prompt_tokens": PROMPT_WORDS, "max_tokens": MAX_TOKENS,
            "latency_no_hit_median_s": statistics.median(cold),
            "latency_prefix_hit_median_s": statistics.median(hit),
            "conformance_suite_s": suite, "load_average_start": load_start, **stamp()}
    save("vllm", data)
    return data


def report(d: dict) -> list[str]:
    return [
        f"vLLM {d['version']} (CPU build, `--enforce-eager`) serving the tiny model "
        "(local/vllm_server): one server started and stopped, "
        f"{d['prompt_tokens']}-token prompts with {d['max_tokens']} output tokens, median of 10; "
        "then `pytest tests/conformance` with its own server. Load average at the start: "
        f"{d['load_average_start']}.", "",
        "| server start | memory (RSS, with the engine core) | request, no prefix hit | request, "
        "full prefix hit | conformance suite (target < 180 s) |", "|---|---|---|---|---|",
        f"| {d['startup_s']:.0f} s | {d['rss_mib']:.0f} MiB | {d['latency_no_hit_median_s'] * 1000:.0f} ms "
        f"| {d['latency_prefix_hit_median_s'] * 1000:.0f} ms | {d['conformance_suite_s']:.0f} s |"]
