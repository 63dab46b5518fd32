"""Capture Envoy's gRPC access log entries (ALS) from the real data plane, as test data for the
picker's outcome parser (picker/tests/data/als-envoy-1.39.jsonl; picker/tests/test_outcomes.py).

    flock /work/heavy.lock .venv/bin/python picker/tests/capture_als.py [OUT]

Starts the local stack (simulated groups at A10 timing / SPEEDUP, the picker, Envoy Gateway and
Envoy with the repo's own gateway objects: overlays/a10-open-gateway + components/edge-security),
adds a second ALS sink beside the picker's (same match) that sends to a recording server here, then
sends one request of each kind through llm-gw and writes, per request, what the client saw (status,
usage, its own first-token and end times) and the raw StreamAccessLogsMessage entries as JSON.
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import json_format

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "picker" / "src")]

from local import dataplane  # noqa: E402
from local.stack import Stack, StackConfig  # noqa: E402
from local.stack.processes import free_ports  # noqa: E402

OUT = ROOT / "picker" / "tests" / "data" / "als-envoy-1.39.jsonl"
SPEEDUP = 5.0  # slow enough that a streamed answer's first token comes well after its headers
PROMPT = "Tell me about access logs and what they carry. " * 40
REQUESTS = [  # name, path, body, body mode comes from the stack
    ("completion", "/v1/completions", {"model": "qwq", "prompt": PROMPT, "max_tokens": 12}),
    ("completion-stream", "/v1/completions",
     {"model": "qwq", "prompt": PROMPT, "max_tokens": 12, "stream": True,
      "stream_options": {"include_usage": True}}),
    ("chat", "/v1/chat/completions",
     {"model": "qwq", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 9}),
    ("chat-stream", "/v1/chat/completions",
     {"model": "qwq", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 9,
      "stream": True, "stream_options": {"include_usage": True}}),
    ("chat-stream-no-usage", "/v1/chat/completions",
     {"model": "qwq", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True}),
    ("upstream-400", "/v1/completions", {"model": "qwq", "prompt": "hi", "max_tokens": 10 ** 7}),
]


class Recorder(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self):
        self.messages: list[als_pb2.StreamAccessLogsMessage] = []

    async def StreamAccessLogs(self, request_iterator, context):
        async for message in request_iterator:
            self.messages.append(message)
        return als_pb2.StreamAccessLogsResponse()

    def entries(self) -> list:
        return [e for m in self.messages for e in m.http_logs.log_entry]


def add_capture_sink(stack: Stack, port: int) -> None:
    """A second ALS sink, plaintext, to 127.0.0.1:port, with the picker sink's match."""
    path = stack.layout.resources / "gateway.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    proxy = next(d for d in docs if d["kind"] == "EnvoyProxy")
    settings = proxy["spec"]["telemetry"]["accessLog"]["settings"]
    picker_setting = next(s for s in settings if any(k["type"] == "ALS" for k in s["sinks"]))
    ns = proxy["metadata"]["namespace"]
    docs.append({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "Backend",
                 "metadata": {"name": "als-capture", "namespace": ns},
                 "spec": {"endpoints": [{"ip": {"address": "127.0.0.1", "port": port}}]}})
    settings.append({"matches": picker_setting["matches"], "sinks": [{"type": "ALS", "als": {
        "type": "HTTP", "logName": "capture", "http": picker_setting["sinks"][0]["als"]["http"],
        "backendRefs": [{"group": "gateway.envoyproxy.io", "kind": "Backend", "name": "als-capture"}]}}]})
    dataplane.write_atomically(path, dataplane.dump(docs))
    deadline = time.monotonic() + 60
    import urllib.request
    while b'"capture"' not in urllib.request.urlopen(f"{stack.envoy_admin()}/config_dump", timeout=5).read():
        assert time.monotonic() < deadline, "Envoy never got the capture sink"
        time.sleep(0.2)


async def send(session, url: str, body: dict) -> dict:
    started = time.time()
    first = None
    async with session.post(url, json=body) as r:
        status = r.status
        if body.get("stream") and status == 200:
            usage = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if first is None and event.get("choices"):
                        first = time.time()
                    usage = event.get("usage") or usage
        else:
            data = await r.json(content_type=None)
            usage = data.get("usage") if isinstance(data, dict) else None
    return {"status": status, "usage": usage, "client_ttft_s": first - started if first else None,
            "client_duration_s": time.time() - started}


async def capture(stack: Stack, recorder: Recorder, body_mode: str) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession(headers=stack.auth_headers()) as session:
        for name, path, body in REQUESTS:
            before = len(recorder.entries())
            seen = await send(session, f"http://127.0.0.1:{stack.llm_port}{path}", body)
            deadline = time.monotonic() + 10
            while len(recorder.entries()) == before:  # Envoy flushes its buffer every second
                assert time.monotonic() < deadline, f"{name}: no access log entry"
                await asyncio.sleep(0.05)
            entries = recorder.entries()[before:]
            rows.append({"name": name, "body_mode": body_mode, "path": path, "client": seen,
                         "entries": [json_format.MessageToDict(e) for e in entries]})
    return rows


async def main(out: Path) -> None:
    rows = []
    for body_mode in ("full-duplex", "buffered"):
        server = grpc.aio.server()
        recorder = Recorder()
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(recorder, server)
        capture_port, *ports = free_ports(10)
        server.add_insecure_port(f"127.0.0.1:{capture_port}")
        await server.start()
        with tempfile.TemporaryDirectory() as tmp:
            config = StackConfig(name=f"als-{body_mode}", run_root=Path(tmp), groups=2, speedup=SPEEDUP,
                                 seed=3, body_mode=body_mode, sim_ports=ports[6:8], http_port=ports[0],
                                 llm_port=ports[1], picker_grpc_port=ports[2], picker_health_port=ports[3],
                                 picker_metrics_port=ports[4], picker_outcomes_port=ports[5])
            stack = Stack(config).start()
            try:
                add_capture_sink(stack, capture_port)
                rows += await capture(stack, recorder, body_mode)
            finally:
                stack.stop()
        await server.stop(0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"{len(rows)} requests, {sum(len(r['entries']) for r in rows)} entries -> {out}")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
