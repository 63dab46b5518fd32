"""What precise prefix routing costs the picker: decoding and indexing the engines' KV-cache
events, the memory per endpoint, and the decision.

    python -m bench kv-events          # or: python -m bench.picker.kvevents [--seconds 5]

1. In process, one thread: decode + follow (signals/kvstate.py) + the workers' index
   (scheduling/kvindex.py) per batch, for the batches a real vLLM 0.32 published
   (../shared/vllm-samples/) and for a busy engine's typical batches at steady state (cache
   full: each new block evicts one), in vLLM 0.32's map form and v0.11's array form.
2. Memory: the signals process's tracker and one worker's index, per endpoint, at 4,096 and
   16,384 blocks per endpoint (tracemalloc).
3. Over ZMQ: the real subscriber (kvsubscriber.py, as the signals process runs it) on 16, 256
   and 1,024 endpoints, each a PUB socket in another process publishing busy-engine batches;
   the subscriber process's CPU (all threads) per second of events, and per batch.
4. The decision: Router.decide() in process on 16 endpoints, 8 tenants x 1,000-token system
   prompts + 3,000-token questions (chat, the tiny model's tokenizer): approximate only vs
   precise (every tenant's prefix cached on one endpoint per the events).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import time
import tracemalloc
from pathlib import Path

import msgspec

from bench.common import load_average, save, stamp

BS = 16
STORE_BLOCKS = 8          # busy engine, one step: a chunk of prefill / decode fills 8 blocks ...
RATE = 20                 # ... and publishes 20 such batches a second (see README/method)
CAPTURE = Path(__file__).resolve().parents[2].parent / "shared" / "vllm-samples" / \
    "kv-events-vllm-0.32.0.jsonl"


class Busy:
    """A busy engine at steady state: every batch stores STORE_BLOCKS new blocks chained on the
    previous ones and removes as many of the oldest (LRU), one BlockRemoved each, as vLLM does."""

    def __init__(self, seed: int, array_form: bool = False):
        self.rng = random.Random(seed)
        self.held: list[int] = []
        self.array_form = array_form
        self.capacity = 4096

    def batch(self) -> bytes:
        rng = self.rng
        parent = self.held[-1] if self.held and rng.random() < 0.7 else None
        hashes = [rng.getrandbits(64) for _ in range(STORE_BLOCKS)]
        tokens = [rng.randrange(150000) for _ in range(STORE_BLOCKS * BS)]
        removed = []
        if len(self.held) + STORE_BLOCKS > self.capacity:
            removed, self.held = self.held[:STORE_BLOCKS], self.held[STORE_BLOCKS:]
        self.held.extend(hashes)
        if self.array_form:
            events = [["BlockRemoved", [h], "GPU"] for h in removed]
            events.append(["BlockStored", hashes, parent, tokens, BS, None, "GPU"])
        else:
            events = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                      for h in removed]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                           "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": None, "group_idx": 0,
                           "kv_cache_spec_kind": "full_attention"})
        return msgspec.msgpack.encode([time.time(), events, 0])


def _per_batch(warm: list[bytes], timed: list[bytes], repeat: int, capacity: int = 4096) -> dict:
    """CPU per batch of `timed`, applied after `warm` to a fresh tracker and index, `repeat`
    times; the index gets the deltas through pickle, as a worker does."""
    import pickle

    from picker.scheduling.kvindex import PreciseIndex
    from picker.signals.kvevents import decode_payload
    from picker.signals.kvstate import KVTracker
    t0 = time.process_time()
    for _ in range(repeat):
        for p in timed:
            decode_payload(p)
    n = repeat * len(timed)
    decode = (time.process_time() - t0) / n
    follow_t = index_t = 0.0
    for _ in range(repeat):
        tracker, index = KVTracker(bytes_per_second=1e12), PreciseIndex()
        tracker.add("e", 0.0, replay=False)
        tracker.set_capacity("e", capacity, BS)
        for seq, p in enumerate(warm):
            tracker.on_message("e", seq, p, 0.0)
        index.apply(tracker.take_deltas())
        for seq, p in enumerate(timed, start=len(warm)):
            a = time.process_time()
            tracker.on_message("e", seq, p, 0.0)
            deltas = pickle.dumps(tracker.take_deltas())
            b = time.process_time()
            index.apply(pickle.loads(deltas))
            follow_t += b - a
            index_t += time.process_time() - b
    ep = tracker.endpoints["e"]
    blocks = sum(len(getattr(e, "block_hashes", ())) for p in timed
                 for e in decode_payload(p).events) / len(timed)
    return {"batches": n, "bytes_per_batch": round(sum(map(len, timed)) / len(timed)),
            "blocks_per_batch": round(blocks, 1), "decode_us": decode * 1e6,
            "decode_follow_us": follow_t / n * 1e6, "index_us": index_t / n * 1e6,
            "in_sync": ep.in_sync, "overflow": ep.stats.overflow}


def in_process() -> dict:
    out = {}
    if CAPTURE.is_file():
        lines = [json.loads(x) for x in CAPTURE.read_text().splitlines()]
        import base64
        caps = [base64.b64decode(m["payload_b64"]) for m in lines
                if m["run"] == "blocks64" and m["source"] == "pub"]
        out["vllm-0.32 capture (128-token blocks)"] = _per_batch([], caps, 300, capacity=64)
    for name, array_form in (("busy engine, map form (vLLM 0.32)", False),
                             ("busy engine, array form (vLLM 0.11)", True)):
        eng = Busy(1, array_form)
        payloads = [eng.batch() for _ in range(1200)]  # the cache fills (4,096 blocks), then steady
        out[name] = _per_batch(payloads[:600], payloads[600:], 3)
    return out


def memory(endpoints: int = 16) -> dict:
    import pickle

    from picker.scheduling.kvindex import PreciseIndex
    from picker.signals.kvstate import KVTracker
    out = {}
    for blocks in (4096, 16384):
        tracemalloc.start()
        tracker, index = KVTracker(bytes_per_second=1e12), PreciseIndex()
        rng = random.Random(blocks)
        for i in range(endpoints):
            addr = f"10.0.0.{i}:8000"
            tracker.add(addr, 0.0, replay=False)
            tracker.set_capacity(addr, blocks, BS)
        base = tracemalloc.get_traced_memory()[0]
        t_mem = i_mem = 0
        for i in range(endpoints):
            addr = f"10.0.0.{i}:8000"
            for seq in range(blocks // 64):
                hashes = [rng.getrandbits(64) for _ in range(64)]
                payload = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": hashes,
                                                         "parent_block_hash": None,
                                                         "token_ids": [seq % 30000] * (64 * BS),
                                                         "block_size": BS}], 0])
                tracker.on_message(addr, seq, payload, 0.0)
            deltas = pickle.dumps(tracker.take_deltas())  # as a worker gets them
            before = tracemalloc.get_traced_memory()[0]
            index.apply(pickle.loads(deltas))
            i_mem += tracemalloc.get_traced_memory()[0] - before
            del deltas
        total = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        t_mem = total - i_mem
        out[str(blocks)] = {"tracker_bytes_per_endpoint": t_mem // endpoints,
                            "index_bytes_per_endpoint": i_mem // endpoints,
                            "blocks_per_endpoint": index.size() // endpoints}
    return out


def _publisher(n: int, rate: float, seconds: float, ports, ready, done) -> None:
    import zmq
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 8192)
    socks, engines = [], []
    for i in range(n):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 100000)
        ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
        socks.append(s)
        eng = Busy(i)
        eng.capacity = 1024
        engines.append(eng)
    pools = [[e.batch() for _ in range(64)] for e in engines[:1]]  # unused: fresh batches below
    del pools
    ready.set()
    time.sleep(1.0 + n / 256)  # the subscriber connects every socket (the slow joiner)
    seq = [0] * n
    interval = 1.0 / rate
    t_end = time.monotonic() + seconds
    nxt = time.monotonic()
    sent = 0
    while time.monotonic() < t_end:
        for i in range(n):
            socks[i].send_multipart([b"kv", seq[i].to_bytes(8, "big"), engines[i].batch()])
            seq[i] += 1
            sent += 1
        nxt += interval
        time.sleep(max(0.0, nxt - time.monotonic()))
    done.value = sent
    time.sleep(1.0)
    for s in socks:
        s.close(0)
    ctx.term()


def over_zmq(n: int, rate: float, seconds: float) -> dict:
    from picker.kvsubscriber import KVSubscriber
    from picker.signals.kvstate import KVTracker
    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    ports, ready, done = mgr.list(), ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_publisher, args=(n, rate, seconds, ports, ready, done), daemon=True)
    proc.start()
    ready.wait(60)
    sub = KVSubscriber(KVTracker(bytes_per_second=1e9))
    sub.start()
    for i, port in enumerate(list(ports)):
        sub.subscribe(f"127.0.0.1:{20000 + i}", f"tcp://127.0.0.1:{port}", None)
    time.sleep(0.9 + n / 256)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    w0 = time.monotonic()
    proc.join(seconds + 30)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic() - w0
    time.sleep(0.2)
    tracker = sub.tracker
    applied = sum(ep.stats.batches for ep in tracker.endpoints.values())
    dropped = sum(ep.stats.dropped + ep.stats.gaps for ep in tracker.endpoints.values())
    sub.stop()
    mgr.shutdown()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"endpoints": n, "rate_per_endpoint": rate, "seconds": round(wall, 2),
            "published": done.value, "applied": applied, "gaps_or_dropped": dropped,
            "cpu_s": round(cpu, 3), "cores": round(cpu / wall, 3),
            "cpu_us_per_batch": round(cpu / max(applied, 1) * 1e6, 1),
            "cores_at_busy_rate": round(cpu / max(applied, 1) * n * RATE, 3)}


def decisions(repeat: int = 4) -> dict:
    import tempfile

    from local.tinymodel.tokenizer import write_tokenizer
    from loadtest.prompts import VOCABULARY
    from picker.core import RequestInfo, Router
    from picker.scheduling.profile import load_profile
    from picker.signals.kvevents import BlockStored
    from picker.tokenizer import ModelTokenizer
    tok = ModelTokenizer(write_tokenizer(Path(tempfile.mkdtemp(prefix="tiny-model-"))))
    rng = random.Random(0)
    systems = [" ".join(str(rng.choice(VOCABULARY)) for _ in range(1000)) for _ in range(8)]

    def body():
        return json.dumps({"model": "qwq", "max_tokens": 8, "messages": [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": " ".join(str(rng.choice(VOCABULARY)) for _ in range(3000))}]}
        ).encode()
    bodies = [body() for _ in range(100)]
    page = ('vllm:num_requests_waiting{model_name="qwq"} 0\nvllm:num_requests_running{model_name="qwq"} 1\n'
            'vllm:kv_cache_usage_perc{model_name="qwq"} 0.3\n'
            f'vllm:cache_config_info{{block_size="{BS}",model_name="qwq",num_gpu_blocks="4000"}} 1\n')
    out = {}
    for precise in (False, True):
        r = Router(load_profile("default"), rng=random.Random(0))
        eps = [f"10.0.0.{i}:8000" for i in range(16)]
        r.set_endpoints(eps)
        for e in eps:
            r.on_scrape_ok(e, page)
        if precise:
            r.enable_precise(tok)
            for e in eps:
                r.on_kv_events(e, [])
            for i, system in enumerate(systems):
                ids = tok.request_tokens("/v1/chat/completions", {"messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": "x"}]})
                n = len(ids) // BS
                r.on_kv_events(eps[i], [BlockStored(block_hashes=[rng.getrandbits(64) for _ in range(n)],
                                                    parent_block_hash=None, token_ids=ids[:n * BS],
                                                    block_size=BS)])
        times = []
        for b in bodies * repeat:
            for e in eps:  # fresh scrapes: in-flight counts do not pile up
                r.on_scrape_ok(e, page)
            t = time.perf_counter()
            d = r.decide(RequestInfo("/v1/chat/completions", {}, b))
            times.append(time.perf_counter() - t)
            r.on_request_done(d.request_id)
        times.sort()
        out["precise" if precise else "approximate"] = {
            "decisions": len(times), "mean_ms": sum(times) / len(times) * 1e3,
            "p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
            "last_cached_tokens": d.cached_tokens, "last_prompt_tokens": d.prompt_tokens}
    return out


def _demo_rate() -> float | None:
    """Batches per second one simulated engine publishes under the demo workload
    (`python -m bench kv-rate`, lab/kv_rate.py), if that has run."""
    from bench.common import load
    d = load("kv-rate")
    try:
        return d["rate"]["per_engine_per_model_s"]["mean"]["batches"]
    except (TypeError, KeyError):
        return None


def run(seconds: float = 5.0) -> dict:
    started = load_average()
    t0 = time.monotonic()
    data = {"command": "python -m bench kv-events", "load_average_start": started,
            "per_batch": in_process(), "memory": memory(), "decisions": decisions(),
            "zmq": [over_zmq(16, RATE, seconds), over_zmq(256, 10, seconds),
                    over_zmq(1024, 4, seconds)],
            "busy_rate": RATE, "store_blocks": STORE_BLOCKS, "demo_rate": _demo_rate()}
    data["wall_s"] = time.monotonic() - t0
    data.update(stamp())
    save("kv-events", data)
    return data


def report(d: dict) -> list[str]:
    lines = [f"Command: `{d['command']}` (`bench/picker/kvevents.py`). A busy engine's batch: "
             f"{d['store_blocks']} blocks of {BS} tokens stored, as many evicted (one BlockRemoved "
             f"each, as vLLM sends them), at {d['busy_rate']} batches/s per endpoint.", "",
             "CPU per batch, in process, one thread (decode; decode + follow, the signals "
             "process's part; the index update, each worker's part):", "",
             "| batches | bytes | blocks | decode us | decode + follow us | worker index us |",
             "|---|---|---|---|---|---|"]
    for name, r in d["per_batch"].items():
        lines.append(f"| {name} | {r['bytes_per_batch']:,} | {r['blocks_per_batch']} | "
                     f"{r['decode_us']:.1f} | {r['decode_follow_us']:.1f} | {r['index_us']:.1f} |")
    lines += ["", "Over ZMQ: the subscriber as the signals process runs it, publishers in another "
              "process on loopback; CPU of the subscribing process (all threads):", "",
              "| endpoints | batches/s per endpoint | applied / published | gaps or drops | cores "
              "| CPU us per batch | cores at the busy rate (projected) | cores at the demo rate "
              "(projected) |", "|---|---|---|---|---|---|---|---|"]
    demo = d.get("demo_rate")
    for z in d["zmq"]:
        at_demo = (f"{z['cpu_us_per_batch'] * 1e-6 * z['endpoints'] * demo:.2f}" if demo else "n/a")
        lines.append(f"| {z['endpoints']:,} | {z['rate_per_endpoint']} | {z['applied']:,} / "
                     f"{z['published']:,} | {z['gaps_or_dropped']} | {z['cores']:.2f} | "
                     f"{z['cpu_us_per_batch']:.0f} | {z['cores_at_busy_rate']:.2f} | {at_demo} |")
    lines += ["", f"Busy rate: {d['busy_rate']} batches/s per endpoint of {2 * d['store_blocks']} "
              "blocks each; demo rate: " + (f"{demo:.1f} batches/s per engine, what the simulator "
              "publishes under the demo workload (`kv-rate`, model time)" if demo else
              "not measured (run `python -m bench kv-rate` first)") + ". Projections: measured CPU "
              "per batch x endpoints x rate."]
    lines += ["", "Memory per endpoint (tracemalloc; the tracker lives in the signals process, the "
              "index in every worker):", "", "| blocks per endpoint | tracker | index (per worker) |",
              "|---|---|---|"]
    for blocks, m in d["memory"].items():
        lines.append(f"| {int(blocks):,} | {m['tracker_bytes_per_endpoint'] / 1e6:.2f} MB | "
                     f"{m['index_bytes_per_endpoint'] / 1e6:.2f} MB |")
    dec = d["decisions"]
    lines += ["", "Decision (Router.decide in process, 16 endpoints, chat prompts of ~4,000 tokens "
              "sharing 8 tenants' ~1,000-token system prompts, the tiny model's tokenizer):", "",
              "| routing | mean ms | p50 ms | p99 ms |", "|---|---|---|---|"]
    for name in ("approximate", "precise"):
        r = dec[name]
        lines.append(f"| {name} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.picker.kvevents", description=__doc__)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    d = run(a.seconds)
    print("\n".join(report(d)))
