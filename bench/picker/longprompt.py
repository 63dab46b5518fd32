"""Long prompts (agentic traffic): 1k-, 32k- and 100k-token requests, part `long` of
`python -m bench.picker`.

Every request is a chat request of one of 8 tenants: its 1,000-token system prompt plus a user
message filling the rest; precise prefix routing is on (the tiny model's tokenizer, built here;
each tenant's system prompt cached on one of the 16 endpoints per its KV-cache events), so every
decision tokenizes its prompt as the deployed picker does (up to the profile's prefix window).

1. In process: `Router.decide()` CPU per decision (thread CPU time), and the memory one request
   held by flow control keeps (tracemalloc: the body, its parsed form, the queue entry).
2. Through gRPC, FULL_DUPLEX_STREAMED with the body in 16 KiB messages (as Envoy streams a long
   prompt), on each ext_proc server: the server's CPU per decision (closed loop, 8 streams), and
   the memory per held request (flow control holding every request while no endpoint has room:
   growth of the server's RSS / requests held).
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import random
import subprocess
import tempfile
import time
import tracemalloc
from pathlib import Path

TOKENS = (1_000, 32_000, 100_000)
CHUNK = 16 * 1024            # bytes per request_body message through gRPC
ENDPOINTS = 16
TENANTS = 8
BS = 16                      # the engines' KV block size (tokens)
HELD = 128                   # requests held at once for the memory figures
BODIES = 20                  # distinct bodies per size, sent in turn
DECISIONS = {1_000: 300, 32_000: 60, 100_000: 30}   # in process, per size
ROOM = ('vllm:num_requests_waiting{model_name="qwq"} 0\nvllm:num_requests_running{model_name="qwq"} 1\n'
        'vllm:kv_cache_usage_perc{model_name="qwq"} 0.3\n'
        f'vllm:cache_config_info{{block_size="{BS}",model_name="qwq",num_gpu_blocks="40000"}} 1\n')
FULL = ROOM.replace("waiting{model_name=\"qwq\"} 0", "waiting{model_name=\"qwq\"} 3")  # no room: held


def _tokenizer():
    from local.tinymodel.tokenizer import write_tokenizer
    from picker.tokenizer import ModelTokenizer
    return ModelTokenizer(write_tokenizer(Path(tempfile.mkdtemp(prefix="tiny-model-"))))


def _systems() -> list[str]:
    from loadtest.prompts import VOCABULARY
    rng = random.Random(0)
    return [" ".join(str(rng.choice(VOCABULARY)) for _ in range(1000)) for _ in range(TENANTS)]


def precise_router(tok, metrics=None):
    """16 endpoints with room, precise routing on, each tenant's system prompt cached on one."""
    from picker.core import Router
    from picker.scheduling.profile import load_profile
    from picker.signals.kvevents import BlockStored
    from picker.signals.metrics import parse_vllm_metrics
    rng = random.Random(1)
    r = Router(load_profile("default"), rng=random.Random(0), metrics=metrics)
    eps = [f"10.0.0.{i + 1}:8000" for i in range(ENDPOINTS)]
    r.set_endpoints(eps)
    pages = {"room": parse_vllm_metrics(ROOM), "full": parse_vllm_metrics(FULL)}
    for e in eps:
        r.on_metrics(e, pages["room"])
    r.enable_precise(tok)
    for e in eps:
        r.on_kv_events(e, [])
    for i, system in enumerate(_systems()):
        ids = tok.request_tokens("/v1/chat/completions", {"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "x"}]})
        n = len(ids) // BS
        r.on_kv_events(eps[i % ENDPOINTS], [BlockStored(
            block_hashes=[rng.getrandbits(64) for _ in range(n)], parent_block_hash=None,
            token_ids=ids[:n * BS], block_size=BS)])
    return r, eps, pages


def make_bodies(tokens: int, count: int, seed: int = 2) -> list[bytes]:
    """`count` chat bodies of about `tokens` tokens (the tiny model: one token per word)."""
    from loadtest.prompts import VOCABULARY
    rng = random.Random(seed)
    systems = _systems()
    words = max(1, tokens - 1000)
    return [json.dumps({"model": "qwq", "max_tokens": 64, "stream": True, "messages": [
        {"role": "system", "content": rng.choice(systems)},
        {"role": "user", "content": " ".join(str(rng.choice(VOCABULARY)) for _ in range(words))}]}
    ).encode() for _ in range(count)]


def in_process(tok) -> list[dict]:
    from picker.core import RequestInfo
    from picker.flowcontrol.controller import FlowControl, FlowSettings
    from picker.flowcontrol.queue import QueueLimits
    out = []
    for tokens in TOKENS:
        bodies = make_bodies(tokens, BODIES)
        r, eps, pages = precise_router(tok)
        for b in bodies:  # warm: the tokenizer's window cache has seen every body (the gRPC
            r.on_request_done(r.decide(RequestInfo("/v1/chat/completions", {}, b)).request_id)  # warm-up too)
        cpu = []
        d = None
        for i in range(DECISIONS[tokens]):
            c0 = time.thread_time()
            d = r.decide(RequestInfo("/v1/chat/completions", {}, bodies[i % len(bodies)]))
            cpu.append(time.thread_time() - c0)
            r.on_request_done(d.request_id)
        # memory: HELD requests waiting in flow control (no endpoint has room), each its own body
        r, eps, pages = precise_router(tok)
        for e in eps:
            r.on_metrics(e, pages["full"])
        flow = FlowControl(r, FlowSettings(QueueLimits(max_requests=10 * HELD, max_wait=600.0)))
        copies = [bytes(bytearray(bodies[i % len(bodies)])) for i in range(HELD)]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for b in copies:
            flow.submit(RequestInfo("/v1/chat/completions", {}, b), lambda outcome: None)
        held = len(flow.queue)
        per_held = (tracemalloc.get_traced_memory()[0] - before) / max(1, held)
        tracemalloc.stop()
        cpu.sort()
        out.append({"tokens": tokens, "prompt_tokens": d.prompt_tokens, "cached_tokens": d.cached_tokens,
                    "body_bytes": len(bodies[0]), "decisions": len(cpu),
                    "cpu_ms_per_decision": 1000 * sum(cpu) / len(cpu),
                    "cpu_p50_ms": 1000 * cpu[len(cpu) // 2], "held": held,
                    "held_bytes_per_request": per_held + len(bodies[0]),
                    "held_overhead_bytes": per_held})
    return out


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _serve(server: str, hold: bool, port_q, ctl, replies) -> None:
    """Child: the picker's ext_proc server over the precise router; with `hold`, flow control on
    and the endpoints' room switched by `ctl` ("room" / "full"); "report": held count and RSS."""
    from picker.flowcontrol.controller import FlowControl, FlowSettings
    from picker.flowcontrol.queue import QueueLimits
    from picker.observability.metrics import PickerMetrics
    from picker.protocol.server import start_servers
    from picker.runtime import run_loop

    async def main():
        router, eps, pages = precise_router(_tokenizer(), metrics=PickerMetrics())
        flow = FlowControl(router, FlowSettings(QueueLimits(max_requests=10 * HELD, max_wait=120.0))) \
            if hold else None
        servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", flow=flow,
                                      server=server)
        port_q.put(servers.grpc_port)
        page = pages["room"]
        while True:
            await asyncio.sleep(0.1)  # a scrape of every endpoint, already parsed (signals process)
            for e in eps:
                router.on_metrics(e, page)
            try:
                cmd = ctl.get_nowait()
            except queue.Empty:
                continue
            if cmd in pages:
                page = pages[cmd]
            replies.put({"held": len(flow.queue) if flow else 0, "rss_kb": _rss_kb()})
    run_loop(main())


class _Child:
    def __init__(self, server: str, hold: bool):
        ctx = mp.get_context("spawn")
        self.port_q, self.ctl, self.replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(server, hold, self.port_q, self.ctl, self.replies),
                                daemon=True)
        self.proc.start()
        self.port = self.port_q.get(timeout=120)

    def ask(self, cmd: str) -> dict:
        self.ctl.put(cmd)
        return self.replies.get(timeout=30)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join()


def through_grpc(server: str, tokens: int, bodies_path: str, seconds: float) -> dict:
    from bench.picker.service import LOAD_CLIENT, _cpu_seconds, _load_client
    child = _Child(server, hold=False)
    try:
        _load_client(child.port, bodies_path, "full-duplex", 1.0, streams=8, chunk=CHUNK)  # warm-up
        cpu0, t0 = _cpu_seconds(child.proc.pid), time.perf_counter()
        r = _load_client(child.port, bodies_path, "full-duplex", seconds, streams=8, chunk=CHUNK)
        cpu = _cpu_seconds(child.proc.pid) - cpu0
        r["server_cpu_ms_per_request"] = 1000 * cpu / max(1, r["requests"])
        r["server_cpu_cores"] = cpu / (time.perf_counter() - t0)
    finally:
        child.stop()
    held = _held_memory(server, bodies_path, LOAD_CLIENT)
    return {"server": server, "tokens": tokens, "closed_loop": r, **held}


def _held_memory(server: str, bodies_path: str, client: str) -> dict:
    """RSS growth per request while flow control holds HELD of them (streams open, bodies in)."""
    from bench.picker.service import _load_client
    child = _Child(server, hold=True)
    try:
        _load_client(child.port, bodies_path, "full-duplex", 1.0, streams=8, chunk=CHUNK)  # warm-up
        child.ask("full")
        time.sleep(0.3)
        base = child.ask("report")
        rate = HELD / 2.0
        cmd = [client, "-addr", f"127.0.0.1:{child.port}", "-bodies", bodies_path, "-mode", "full-duplex",
               "-seconds", "2", "-warmup", "0", "-rate", str(rate), "-response-phase=false",
               "-chunk", str(CHUNK)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        held = base
        while time.monotonic() < deadline:
            time.sleep(0.5)
            held = child.ask("report")
            if held["held"] >= HELD - 1:
                time.sleep(0.5)
                held = child.ask("report")
                break
        child.ask("room")  # every held request dispatched: the client finishes
        out, _ = proc.communicate(timeout=120)
        client_result = json.loads(out)
    finally:
        child.stop()
    n = max(1, held["held"])
    return {"held": held["held"], "rss_base_kb": base["rss_kb"], "rss_held_kb": held["rss_kb"],
            "held_bytes_per_request": 1024 * (held["rss_kb"] - base["rss_kb"]) / n,
            "held_client": client_result}


def run(servers: list[str], seconds: float, say=print) -> dict:
    say("\nlong prompts (chat, precise prefix routing, 16 endpoints):")
    tok = _tokenizer()
    inproc = in_process(tok)
    for x in inproc:
        say(f"  in process {x['tokens']:>7,} tokens ({x['body_bytes']:,} B): "
            f"{x['cpu_ms_per_decision']:.2f} ms CPU/decision, held {x['held_bytes_per_request'] / 1024:.0f} KiB/request")
    grpc = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in TOKENS:
            path = os.path.join(tmp, f"bodies-{tokens}.jsonl")
            with open(path, "wb") as f:
                for b in make_bodies(tokens, BODIES):
                    f.write(b + b"\n")
            for server in servers:
                x = through_grpc(server, tokens, path, seconds)
                grpc.append(x)
                c = x["closed_loop"]
                say(f"  gRPC {server:>6} {tokens:>7,} tokens, {CHUNK // 1024} KiB messages: "
                    f"{c['decisions_per_s']:.0f}/s, {c['server_cpu_ms_per_request']:.2f} ms server CPU/decision, "
                    f"held {x['held']}: {x['held_bytes_per_request'] / 1024:.0f} KiB RSS/request"
                    + (f", {c['errors']} errors ({c.get('first_error')})" if c["errors"] else ""))
    return {"inprocess": inproc, "grpc": grpc, "chunk_bytes": CHUNK, "held_requests": HELD,
            "endpoints": ENDPOINTS}
