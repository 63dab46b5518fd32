"""local.observe: the scrape config derived from the PodMonitors, and finding a running stack."""
from __future__ import annotations

import dataclasses
import json

import pytest

from local import observe
from local.stack import StackConfig


def test_scrape_config_keeps_the_monitors_relabelings_after_renaming_local_listeners():
    config = observe.prometheus_config({"envoy-proxy": [observe.Target("127.0.0.1:1", "envoy-0")]},
                                       listeners={8080: 18080, 8081: 8081})
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "podMonitor/llm/envoy-proxy/0"
    assert job["metrics_path"] == "/stats/prometheus"
    assert {"target_label": "job", "replacement": "envoy", "action": "replace"} in job["relabel_configs"]
    assert job["metric_relabel_configs"] == [
        {"source_labels": ["envoy_http_conn_manager_prefix"], "regex": "http-18080",
         "target_label": "envoy_http_conn_manager_prefix", "replacement": "http-8080"},
        {"action": "replace", "source_labels": ["envoy_http_conn_manager_prefix"],
         "regex": "http-(8080|8081)", "target_label": "listener", "replacement": "$1"}]


def test_a_running_stack_becomes_targets_named_like_the_pods(tmp_path):
    config = StackConfig(name="x", run_root=tmp_path, groups=2, sim_ports=[18101, 18102], picker_metrics_port=19090)
    (tmp_path / "x").mkdir()
    state = {"name": "x", "config": dataclasses.asdict(config), "procs": []}
    (tmp_path / "x/state.json").write_text(json.dumps(state, default=str))
    admin = tmp_path / "x/envoy-gateway/runtime/envoy/admin-address.txt"   # where func-e records it
    admin.parent.mkdir(parents=True)
    admin.write_text("127.0.0.1:19555")
    stack = observe.running_stack("x", tmp_path)
    assert stack.config.run_dir == tmp_path / "x"
    targets = observe.stack_targets(stack)
    assert targets["vllm-leaders"] == [observe.Target("127.0.0.1:18101", "qwq-dist-v1-0"),
                                       observe.Target("127.0.0.1:18102", "qwq-dist-v1-1")]
    assert targets["envoy-proxy"] == [observe.Target("127.0.0.1:19555", "envoy-inference-gateway-0",
                                                     "envoy-gateway-system")]
    assert observe.cluster_listener_ports(stack) == {8080: 18080, 8081: 18081}
    jobs = {j["job_name"]: j for j in observe.stack_config(stack)["scrape_configs"]}
    assert set(jobs) == {"podMonitor/llm/vllm-leaders/0", "podMonitor/llm/picker/0", "podMonitor/llm/envoy-proxy/0"}
    assert jobs["podMonitor/llm/picker/0"]["static_configs"][0]["targets"] == ["127.0.0.1:19090"]
    assert jobs["podMonitor/llm/picker/0"]["honor_labels"] is True
    renames = jobs["podMonitor/llm/envoy-proxy/0"]["metric_relabel_configs"][:2]
    assert [(r["regex"], r["replacement"]) for r in renames] == [("http-18080", "http-8080"), ("http-18081", "http-8081")]


def test_no_running_stack_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="make up"):
        observe.running_stack("absent", tmp_path)
