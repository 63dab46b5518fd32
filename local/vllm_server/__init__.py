"""Real vLLM (its CPU build, pinned in requirements.txt beside this file) serving the tiny model.

`make vllm` installs it into .venv-vllm and builds the model into .cache/tiny-model. This module
only builds command lines and runs processes; it imports nothing from vLLM, so the project's own
virtualenv (tests, the stack launcher) uses it to start servers with the vLLM virtualenv's python.

One `VllmServer` = one port = one engine, like one simulator process: the flags follow the
cluster's (base/vllm: served model name, prefix caching, KV-cache events with a publisher and a
replay port, max model length) as far as a CPU build serving a tiny model can take them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from local.tinymodel import DEFAULT_DIR as MODEL_DIR

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
VERSION = "0.32.0"
KV_TOPIC = "kv"
# The CPU build's KV memory in GiB (vLLM's default is 4): 1 GiB holds 4,096 blocks of 128 tokens
# of the tiny model, far more than any test here fills, and keeps each server near 2 GB.
KV_CACHE_GIB = 1


ENV = {
    "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    # Several servers share a few cores with the rest of the stack: let the OS place the threads
    # instead of pinning every engine to core 0.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
}


class VllmError(RuntimeError):
    """A vLLM server did not start or is not installed."""


def available() -> bool:
    """True when `make vllm` has run: the virtualenv and the built model are there."""
    from local.tinymodel.model import model_ready
    return PYTHON.is_file() and model_ready(MODEL_DIR)


@dataclass(frozen=True)
class VllmServer:
    port: int
    served_model_names: tuple[str, ...] = ("qwq",)
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    kv_events_port: int | None = None      # ZMQ PUB; the replay ROUTER binds kv_replay_port
    kv_replay_port: int | None = None
    kv_topic: str = KV_TOPIC
    num_gpu_blocks: int | None = None      # vLLM's --num-gpu-blocks-override (the KV capacity)
    model_dir: Path = MODEL_DIR
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def kv_events_config(self) -> dict | None:
        if self.kv_events_port is None:
            return None
        # vLLM binds the publisher only for a wildcard host (any other host makes it connect
        # out, as the cluster's validation notes), so it listens on every interface here too;
        # the replay socket always binds, to the server's own host.
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": self.kv_topic,
                  "endpoint": f"tcp://*:{self.kv_events_port}"}
        if self.kv_replay_port is not None:
            config["replay_endpoint"] = f"tcp://{self.host}:{self.kv_replay_port}"
        return config

    def command(self, python: Path = PYTHON) -> list[str]:
        # `python -m ...api_server`: the `vllm` console script looks its version up under the
        # package name `vllm` and fails for the `vllm-cpu` distribution.
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model_dir), "--host", self.host, "--port", str(self.port),
               "--served-model-name", *self.served_model_names,
               "--max-model-len", str(self.max_model_len), "--dtype", "float32",
               "--enable-prefix-caching", "--disable-uvicorn-access-log",
               # as the cluster runs it (overlays/a10); on the CPU build it also skips a
               # torch.compile warm-up of about a minute at every start
               "--enforce-eager"]
        events = self.kv_events_config()
        if events is not None:
            cmd += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return cmd + list(self.extra_args)

    def launch_command(self) -> list[str]:
        """command() under `env` with env()'s changes: for launchers that take an argv only."""
        unset = [a for k in ("PYTHONPATH", "PYTHONHASHSEED") for a in ("-u", k)]
        return ["env", *unset, *(f"{k}={v}" for k, v in ENV.items()), *self.command()]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.pop("PYTHONPATH", None)              # the repo's packages are not vLLM's
        env.pop("PYTHONHASHSEED", None)          # block hashes stay equal across restarts
        env.update(ENV)
        return env


def start(server: VllmServer, log_path: Path) -> subprocess.Popen:
    """Start the server in its own process group (vLLM forks an engine core process)."""
    if not PYTHON.is_file():
        raise VllmError(f"{PYTHON} is missing: run `make vllm` first")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(server.command(), env=server.env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=log_path.parent, start_new_session=True)


def healthy(server: VllmServer, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(server: VllmServer, proc: subprocess.Popen, log_path: Path,
               timeout: float = 600.0) -> None:
    """Until /health answers 200; a server that exits or stays down raises with its log's end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VllmError(f"vLLM on {server.address} exited with {proc.returncode}:\n"
                            f"{_tail(log_path)}")
        if healthy(server):
            return
        time.sleep(1.0)
    raise VllmError(f"vLLM on {server.address} not healthy after {timeout:.0f} s:\n{_tail(log_path)}")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to the server's process group (it stops its engine core), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
