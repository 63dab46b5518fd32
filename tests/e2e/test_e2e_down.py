"""`make up` then `make down`, as a user runs them (two commands, the first one gone when the
second runs): everything `up` started is stopped, every process of every group it started, and
its ports are free again. The simulator here; real vLLM at the end of tests/e2e/test_e2e_vllm.py
(on the stack that module already runs), through `assert_down_stops_everything` below."""

from __future__ import annotations

import subprocess
import sys

import pytest

from local.stack.config import REPO
from local.stack.processes import RunState, free_ports, group_members, port_free, python_env

pytestmark = pytest.mark.e2e


def stack_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "local.stack", *args], cwd=REPO, env=python_env(),
                          capture_output=True, text=True, timeout=timeout)


def assert_down_stops_everything(name: str, run_root, ports: list[int]) -> None:
    """`python -m local.stack down` (what `make down` runs) leaves no process of any group the
    stack recorded and frees its ports."""
    state = RunState.read(run_root / name)
    assert state is not None and state.procs
    groups = [(p.name, p.pid, p.started) for p in state.procs]
    assert all(group_members(pid, started) for _, pid, started in groups)  # all running before
    down = stack_cli("down", "--name", name, "--run-root", str(run_root))
    assert down.returncode == 0, down.stdout + down.stderr
    left = {name: group_members(pid, started) for name, pid, started in groups}
    assert not any(left.values()), f"still running after down: {left}"
    assert [p for p in ports if not port_free("127.0.0.1", p)] == []
    assert RunState.read(run_root / name) is None


def test_down_stops_what_up_started_with_the_simulator(tmp_path):
    ports = free_ports(7)
    args = ["--name", "updown", "--run-root", str(tmp_path), "--groups", "2",
            "--sim-ports", str(ports[0]), str(ports[1]), "--http-port", str(ports[2]), "--llm-port", str(ports[3]),
            "--picker-grpc-port", str(ports[4]), "--picker-health-port", str(ports[5]),
            "--picker-metrics-port", str(ports[6])]
    up = stack_cli("up", *args)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert_down_stops_everything("updown", tmp_path, ports)
    finally:
        stack_cli("down", "--name", "updown", "--run-root", str(tmp_path))
