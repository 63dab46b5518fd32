"""The plan of a stack whose groups are real vLLM servers (engine "vllm")."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from local import vllm_server
from local.stack.config import StackConfig, StackError
from local.stack.plan import vllm_procs
from local.stack.topology import SimGroup


def test_one_real_server_per_group_with_the_cluster_flags(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_server, "available", lambda: True)
    config = StackConfig(engine="vllm", run_root=tmp_path)
    topo = SimGroup("qwq-dist-v1", 8101, ["qwq"]), SimGroup("qwq-dist-v2", 8102, ["qwq", "qwq-canary"])
    procs = vllm_procs(config, SimpleNamespace(sims=list(topo)))
    assert [p.name for p in procs] == ["vllm-8101", "vllm-8102"]
    cmd = procs[1].cmd
    assert cmd[:5] == ["env", "-u", "PYTHONPATH", "-u", "PYTHONHASHSEED"]
    assert "VLLM_CPU_KVCACHE_SPACE=1" in cmd and str(vllm_server.PYTHON) in cmd
    assert cmd[cmd.index("--served-model-name") + 1:cmd.index("--served-model-name") + 3] == ["qwq", "qwq-canary"]
    assert cmd[cmd.index("--port") + 1] == "8102" and "--enable-prefix-caching" in cmd
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    # the second group's ports, as a simulator's; vLLM binds the publisher only on a wildcard host
    assert events["endpoint"] == "tcp://*:18103"
    assert events["replay_endpoint"] == "tcp://127.0.0.1:18104"
    assert events["topic"] == "kv@vllm-8102"
    assert procs[1].health == "http:http://127.0.0.1:8102/health"
    quiet = vllm_procs(StackConfig(engine="vllm", run_root=tmp_path, precise_prefix=False),
                       SimpleNamespace(sims=list(topo)))
    assert "--kv-events-config" not in quiet[0].cmd


def test_without_make_vllm_the_plan_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_server, "available", lambda: False)
    with pytest.raises(StackError, match="make vllm"):
        vllm_procs(StackConfig(engine="vllm", run_root=tmp_path), SimpleNamespace(sims=[]))


def test_an_unknown_engine_is_refused():
    with pytest.raises(StackError, match="engine 'tgi'"):
        StackConfig(engine="tgi")
