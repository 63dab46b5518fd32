"""monitoring.local_prometheus: the scrape config derived from the PodMonitors, and finding a running stack."""
from __future__ import annotations

import pytest

from local.stack import StackConfig
from local.stack.processes import RunState
from monitoring import local_prometheus


def test_scrape_config_keeps_the_monitors_relabelings_after_renaming_local_listeners():
    config = local_prometheus.prometheus_config({"envoy-proxy": [local_prometheus.Target("127.0.0.1:1", "envoy-0")]},
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
    RunState("x", config, []).write(config.run_dir)
    admin = tmp_path / "x/envoy-gateway/runtime/envoy/admin-address.txt"   # where func-e records it
    admin.parent.mkdir(parents=True)
    admin.write_text("127.0.0.1:19555")
    stack = local_prometheus.running_stack("x", tmp_path)
    assert stack.config.run_dir == tmp_path / "x"
    targets = local_prometheus.stack_targets(stack)
    assert targets["vllm-leaders"] == [local_prometheus.Target("127.0.0.1:18101", "qwq-dist-v1-0"),
                                       local_prometheus.Target("127.0.0.1:18102", "qwq-dist-v1-1")]
    assert targets["envoy-proxy"] == [local_prometheus.Target("127.0.0.1:19555", "envoy-inference-gateway-0",
                                                     "envoy-gateway-system")]
    assert local_prometheus.cluster_listener_ports(stack) == {8080: 18080, 8081: 18081}
    jobs = {j["job_name"]: j for j in local_prometheus.stack_config(stack)["scrape_configs"]}
    assert set(jobs) == {"podMonitor/llm/vllm-leaders/0", "podMonitor/llm/picker/0", "podMonitor/llm/envoy-proxy/0"}
    assert jobs["podMonitor/llm/picker/0"]["static_configs"][0]["targets"] == ["127.0.0.1:19090"]
    assert jobs["podMonitor/llm/picker/0"]["honor_labels"] is True
    renames = jobs["podMonitor/llm/envoy-proxy/0"]["metric_relabel_configs"][:2]
    assert [(r["regex"], r["replacement"]) for r in renames] == [("http-18080", "http-8080"), ("http-18081", "http-8081")]


def test_no_running_stack_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="make up"):
        local_prometheus.running_stack("absent", tmp_path)


def test_discovered_pods_carry_the_pod_discovery_labels_the_operator_rules_select_on():
    monitor = {"metadata": {"name": "vllm-leaders", "namespace": "llm"},
               "spec": {"selector": {"matchLabels": {"app": "distributed-serving", "role": "leader"}},
                        "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}]}}
    (job,) = local_prometheus.pod_discovery_jobs(monitor, "/tmp/pods.json", "1s")
    assert job["file_sd_configs"] == [{"files": ["/tmp/pods.json"], "refresh_interval": "1s"}] and "static_configs" not in job
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert [r["regex"] for r in keeps] == ["distributed-serving;true", "leader;true", "http"]
    pod = {"metadata": {"name": "qwq-dist-v1-0", "namespace": "llm",
                        "labels": {"app": "distributed-serving", "leaderworkerset.sigs.k8s.io/name": "qwq-dist-v1"}},
           "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8000},
                                                              {"name": "kv-events", "containerPort": 5557}]}]},
           "status": {"phase": "Running", "podIP": "10.1.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    no_ip = {"metadata": {"name": "new", "namespace": "llm"}, "spec": pod["spec"], "status": {"phase": "Pending"}}
    groups = local_prometheus.pod_discovery_targets([pod, no_ip])
    assert [g["targets"] for g in groups] == [["10.1.0.1:8000"], ["10.1.0.1:5557"]]
    labels = groups[0]["labels"]
    assert labels["__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_name"] == "qwq-dist-v1"
    assert labels["__meta_kubernetes_pod_labelpresent_app"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_name"] == "http"
    assert labels["__meta_kubernetes_pod_ready"] == "true" and labels["__meta_kubernetes_pod_name"] == "qwq-dist-v1-0"
