"""The Ray bootstrap scripts of the vLLM ConfigMap, run with bash against stub `ray`/`python3`."""
from __future__ import annotations

import os
import socket
import subprocess

import pytest

from tests.policy.conftest import find, rendered


@pytest.fixture
def scripts(tmp_path):
    data = find(rendered("base/vllm"), "ConfigMap", "vllm-multinode")["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    # `ray` records its arguments; `python3 -c ...` (the node count query) prints $ALIVE_NODES.
    (stubs / "ray").write_text('#!/bin/bash\necho "ray $*" >> "$CALLS"\n')
    (stubs / "python3").write_text('#!/bin/bash\necho "${ALIVE_NODES:-0}"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    return tmp_path


def run(scripts, script, *args, **env):
    full_env = {"PATH": f"{scripts / 'bin'}:{os.environ['PATH']}", "CALLS": str(scripts / "calls"),
                "VLLM_HOST_IP": "10.0.0.5", **env}
    return subprocess.run(["bash", str(scripts / script), *args], capture_output=True, text=True,
                          env=full_env, timeout=30)


def calls(scripts):
    path = scripts / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_scripts_parse(scripts):
    for name in ("leader.sh", "worker.sh"):
        assert subprocess.run(["bash", "-n", str(scripts / name)]).returncode == 0, name


def test_leader_starts_head_then_execs_the_server(scripts):
    proc = run(scripts, "leader.sh", "echo", "vllm", "serve", LWS_GROUP_SIZE="2", ALIVE_NODES="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "vllm serve"      # the server command ran (exec "$@")
    assert calls(scripts) == ["ray start --head --port=6379 --node-ip-address=10.0.0.5"]


def test_leader_fails_instead_of_starting_vllm_when_workers_never_join(scripts):
    proc = run(scripts, "leader.sh", "echo", "vllm", "serve", LWS_GROUP_SIZE="2", ALIVE_NODES="1",
               RAY_INIT_TIMEOUT_SECONDS="0")
    assert proc.returncode == 1
    assert "only 1/2 nodes joined" in proc.stderr and "vllm serve" not in proc.stdout


def test_leader_needs_the_lws_group_size(scripts):
    proc = run(scripts, "leader.sh", "echo", "x")
    assert proc.returncode != 0 and "LWS_GROUP_SIZE is not set" in proc.stderr


def test_worker_waits_for_the_gcs_port_then_joins(scripts):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        proc = run(scripts, "worker.sh", LWS_LEADER_ADDRESS="127.0.0.1", RAY_PORT=str(port))
    assert proc.returncode == 0, proc.stderr
    assert calls(scripts) == [f"ray start --address=127.0.0.1:{port} --node-ip-address=10.0.0.5 --block"]


def test_worker_gives_up_when_the_leader_is_unreachable(scripts):
    with socket.socket() as probe:            # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = run(scripts, "worker.sh", LWS_LEADER_ADDRESS="127.0.0.1", RAY_PORT=str(port), RAY_INIT_TIMEOUT_SECONDS="0")
    assert proc.returncode == 1 and "unreachable" in proc.stderr and calls(scripts) == []
