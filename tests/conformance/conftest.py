"""Servers for the conformance suite: the simulator, real vLLM (live, when `make vllm` has run)
and the recorded answers of vLLM 0.32 (the shared samples, when present).

Live vLLM: one server for this package's tests (it takes about a minute to start on the CPU
build; package scope stops it before tests/e2e starts its own),
with the cluster's flags as far as they apply (local.vllm_server), on loopback, stopped at the
end. test_lora.py starts a second one with the tiny model's LoRA adapter, for its module only. CONFORMANCE_VLLM=host:port uses a server that is already running instead (its KV-event
ports must then be given as CONFORMANCE_VLLM_KV=pub_port,replay_port to test events).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from local import vllm_server
from tests.conformance.exchanges import Answer

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO.parent / "shared" / "vllm-samples"
MAX_MODEL_LEN = 2048          # the live server's and the recordings' --max-model-len


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


@dataclass(frozen=True)
class Live:
    address: str
    kv_events_port: int | None
    kv_replay_port: int | None


def _start_sim(tmp_path_factory, *extra: str):
    port = free_port()
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "local.sim", "--port", str(port),
                                 "--served-model-name", "qwq", "--speedup", "1000",
                                 "--max-model-len", str(MAX_MODEL_LEN), *extra],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 30)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="package")
def sim(tmp_path_factory) -> str:
    """The simulator with the live server's context length, fast (speedup 1000), LoRA info on,
    counting words as tokens (its default, what the load tests assume)."""
    yield from _start_sim(tmp_path_factory, "--max-loras", "2")


@pytest.fixture(scope="package")
def sim_with_model_tokenizer(tmp_path_factory) -> str:
    """The simulator reading the tiny model's tokenizer, as real vLLM does (--tokenizer)."""
    if not vllm_server.available():
        pytest.skip("the tiny model is built by make vllm")
    yield from _start_sim(tmp_path_factory, "--tokenizer", str(vllm_server.MODEL_DIR))


@pytest.fixture(scope="package")
def live_vllm(tmp_path_factory) -> Live:
    given = os.environ.get("CONFORMANCE_VLLM")
    if given:
        kv = os.environ.get("CONFORMANCE_VLLM_KV")
        pub, replay = (int(p) for p in kv.split(",")) if kv else (None, None)
        yield Live(given, pub, replay)
        return
    if not vllm_server.available():
        pytest.skip("real vLLM is not installed (make vllm)")
    server = vllm_server.VllmServer(port=free_port(), max_model_len=MAX_MODEL_LEN,
                                    kv_events_port=free_port(), kv_replay_port=free_port())
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc = vllm_server.start(server, log)
    try:
        vllm_server.wait_ready(server, proc, log, timeout=600)
        yield Live(server.address, server.kv_events_port, server.kv_replay_port)
    finally:
        vllm_server.stop(proc)


@pytest.fixture(scope="package")
def recorded() -> dict[str, Answer]:
    """The recorded answers of vLLM 0.32 by exchange name."""
    path = SAMPLES / "responses-vllm-0.32.0.jsonl"
    if not path.is_file():
        pytest.skip(f"no recorded vLLM answers at {path}")
    answers = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "body" in rec:
            eos = '"ignore_eos": true' in rec["request"].get("body", "")
            answers[rec["name"]] = Answer(rec["status"], {k.lower(): v for k, v in rec["headers"]},
                                          rec["body"].encode(), eos_comparable=eos)
    return answers


def sample_text(name: str) -> str:
    path = SAMPLES / name
    if not path.is_file():
        pytest.skip(f"no recorded sample {path}")
    return path.read_text()
