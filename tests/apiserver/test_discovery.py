"""The picker's Kubernetes discovery (list + watch through the `kubernetes` client) against the real
API server: the deployed InferencePool, objectives and rewrite, leader pods turning ready and not
ready, relabelled and deleted, and a 410 Gone forced by compacting etcd. The published endpoint set
must follow each change within BOUND seconds."""
from __future__ import annotations

import copy
import json
import threading

import pytest

from picker.discovery.kubernetes import PoolState, api_watches, start_threads
from tests.helpers.kube import POOL, ROOT, wait_until
from validation.apiserver import ServerSideApply, render_targets
from validation.cli import default_crds_dir

BOUND = 5.0      # seconds for a change to reach the picker (a watch event takes milliseconds)


@pytest.fixture(scope="module")
def deployed():
    """The overlay's InferencePool, objectives, rewrite and LeaderWorkerSet, as rendered."""
    objs = render_targets(ROOT, default_crds_dir(ROOT).resolve(), ["overlays/a10"])["overlays/a10"].objects
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def in_namespace(obj, namespace):
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return obj


def leader_labels(deployed):
    """A leader pod's labels: the LWS leader template's plus what the LWS controller adds."""
    lws = deployed[("LeaderWorkerSet", "qwq-dist-v1")]
    labels = dict(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"])
    labels.update({"leaderworkerset.sigs.k8s.io/name": "qwq-dist-v1",
                   "leaderworkerset.sigs.k8s.io/worker-index": "0"})
    return labels


class Cluster:
    """What the kubelet and the LWS controller would do to pods, done by hand."""

    def __init__(self, admin, namespace, labels):
        from kubernetes import client
        self.core, self.namespace, self.labels = client.CoreV1Api(admin), namespace, labels

    def create_pod(self, name, labels=None, node=None):
        """A pod; with `node`, bound to that node, so deleting it is graceful (the API server
        sets deletionTimestamp and waits for the kubelet, as for a real leader)."""
        spec = {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]}
        if node:
            spec["nodeName"] = node
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": name, "labels": labels or self.labels}, "spec": spec})

    def set_ready(self, name, ip, ready=True):
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                  "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    def relabel(self, name, labels):
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"labels": labels}})

    def delete(self, name, grace_period_seconds=None):
        self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace_period_seconds)


@pytest.fixture
def discovery(control_plane, admin, namespace, deployed, tmp_path, monkeypatch):
    """The picker's four watches on `namespace` (short watch timeouts, so resumes happen often)."""
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    sa = ServerSideApply(admin)
    for key in (("InferencePool", POOL), ("InferenceObjective", "batch"), ("InferenceObjective", "interactive"),
                ("InferenceModelRewrite", "qwq")):
        sa.apply(in_namespace(deployed[key], namespace), dry_run=False)
    published = []
    state = PoolState(POOL, lambda eps, objectives, rewrites: published.append((eps, objectives, rewrites)))
    watches = api_watches(state, namespace, timeout_seconds=1)
    stop = threading.Event()
    threads = start_threads(watches, stop)
    wait_until(lambda: state.is_synced, BOUND, "discovery synced")
    yield state, published, {w.kind: w for w in watches}, Cluster(admin, namespace, leader_labels(deployed))
    stop.set()
    for t in threads:
        t.join(timeout=5)


def endpoints(published):
    return published[-1][0] if published else None


def test_endpoints_follow_pod_readiness_labels_and_deletion(discovery):
    state, published, _, cluster = discovery
    assert endpoints(published) == []
    cluster.create_pod("leader-a")
    cluster.create_pod("leader-b")
    wait_until(lambda: set(state.pods) == {"leader-a", "leader-b"}, BOUND, "pods seen")
    assert endpoints(published) == []                    # no IP, not ready
    steps = [
        (lambda: cluster.set_ready("leader-a", "10.1.0.1"), ["10.1.0.1:8000"]),
        (lambda: cluster.set_ready("leader-b", "10.1.0.2"), ["10.1.0.1:8000", "10.1.0.2:8000"]),
        (lambda: cluster.set_ready("leader-a", "10.1.0.1", ready=False), ["10.1.0.2:8000"]),
        (lambda: cluster.relabel("leader-b", {"role": "worker"}), []),          # no longer a leader
        (lambda: cluster.relabel("leader-b", {"role": "leader"}), ["10.1.0.2:8000"]),
        (lambda: cluster.set_ready("leader-a", "10.1.0.1"), ["10.1.0.1:8000", "10.1.0.2:8000"]),
        (lambda: cluster.delete("leader-a"), ["10.1.0.2:8000"]),   # no node: deleted at once
        (lambda: cluster.delete("leader-b"), []),
    ]
    for change, expected in steps:
        change()
        wait_until(lambda: endpoints(published) == expected, BOUND, f"endpoints {expected}")


def test_a_terminating_leader_gets_no_new_request(discovery):
    """Scale-down: the leader of a removed group is terminating (deletionTimestamp set, its
    preStop draining for up to the grace period) while it still serves what it has: the picker
    drops it at once and sends it nothing new; the other leader keeps serving."""
    state, published, _, cluster = discovery
    for name, ip in (("leader-a", "10.1.0.1"), ("leader-b", "10.1.0.2")):
        cluster.create_pod(name, node="gpu-node-0")
        cluster.set_ready(name, ip)
    wait_until(lambda: endpoints(published) == ["10.1.0.1:8000", "10.1.0.2:8000"], BOUND, "both ready")
    cluster.delete("leader-b", grace_period_seconds=3660)
    wait_until(lambda: endpoints(published) == ["10.1.0.1:8000"], BOUND, "terminating leader dropped")
    pod = state.pods["leader-b"]                  # still there, ready, draining: only terminating
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 3660
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
    cluster.set_ready("leader-b", "10.1.0.2")     # a status update while draining changes nothing
    cluster.create_pod("leader-c", node="gpu-node-1")
    cluster.set_ready("leader-c", "10.1.0.3")
    wait_until(lambda: endpoints(published) == ["10.1.0.1:8000", "10.1.0.3:8000"], BOUND, "new leader in")
    cluster.delete("leader-b", grace_period_seconds=0)   # the kubelet confirms: the pod is gone
    wait_until(lambda: "leader-b" not in state.pods, BOUND, "pod removed")
    assert endpoints(published) == ["10.1.0.1:8000", "10.1.0.3:8000"]


def test_objectives_and_rewrite_follow_the_api(discovery, admin):
    from kubernetes import client
    state, published, _, cluster = discovery
    custom = client.CustomObjectsApi(admin)
    ns = cluster.namespace

    def objectives():
        return {o.name: o.priority for o in published[-1][1]}

    def rewrite_targets():
        return [r.rules[0].targets for r in published[-1][2]]

    assert objectives() == {"batch": -10, "interactive": 10}
    assert rewrite_targets() == [(("qwq", 100.0),)]
    custom.patch_namespaced_custom_object("llm-d.ai", "v1alpha2", ns, "inferenceobjectives", "batch",
                                          {"spec": {"priority": -20}})
    wait_until(lambda: objectives() == {"batch": -20, "interactive": 10}, BOUND, "objective priority")
    custom.patch_namespaced_custom_object(
        "llm-d.ai", "v1alpha2", ns, "inferencemodelrewrites", "qwq",
        [{"op": "replace", "path": "/spec/rules/0/targets",
          "value": [{"modelRewrite": "qwq", "weight": 90}, {"modelRewrite": "qwq-v2", "weight": 10}]}],
        _content_type="application/json-patch+json")
    wait_until(lambda: rewrite_targets() == [(("qwq", 90.0), ("qwq-v2", 10.0))], BOUND, "rewrite weights")
    custom.delete_namespaced_custom_object("llm-d.ai", "v1alpha2", ns, "inferenceobjectives", "interactive")
    wait_until(lambda: objectives() == {"batch": -20}, BOUND, "objective deleted")
    custom.delete_namespaced_custom_object("inference.networking.k8s.io", "v1", ns, "inferencepools", POOL)
    wait_until(lambda: state.pool is None, BOUND, "pool deleted")


def watch_answer(core, namespace, resource_version):
    """The status code a pod watch from `resource_version` gets: HTTP status or ERROR event code."""
    from kubernetes.client.exceptions import ApiException
    try:
        resp = core.list_namespaced_pod(namespace, resource_version=resource_version, watch=True,
                                        timeout_seconds=1, _preload_content=False)
    except ApiException as exc:
        return exc.status
    for line in resp.read().decode().splitlines():
        event = json.loads(line)
        if event["type"] == "ERROR":
            return event["object"]["code"]
    return resp.status


def test_watch_expired_by_compaction_relists_and_keeps_following(discovery, control_plane, admin, caplog):
    """Compacting etcd past the resourceVersion the pod watch resumes from makes the API server
    answer 410 Gone; discovery lists again and keeps following changes."""
    from kubernetes import client
    state, published, watches, cluster = discovery
    cluster.create_pod("leader-a")
    cluster.set_ready("leader-a", "10.1.0.1")
    wait_until(lambda: endpoints(published) == ["10.1.0.1:8000"], BOUND, "leader-a ready")
    pods = watches["pods"]
    resume_from = pods.resource_version
    relists = pods.relists
    # Writes elsewhere move etcd on; the pod watch's resourceVersion stays behind them.
    core = client.CoreV1Api(admin)
    for i in range(3):
        core.create_namespaced_config_map(cluster.namespace, {"metadata": {"name": f"churn-{i}"}})
    compacted = control_plane.compact_etcd()
    assert int(resume_from) < compacted
    assert watch_answer(core, cluster.namespace, resume_from) == 410     # the server's own answer
    wait_until(lambda: pods.relists > relists, BOUND, "pods relisted after 410 Gone")
    # Answered as an expired watch (a quiet relist), not as a failure with a backoff.
    assert [r.getMessage() for r in caplog.records if r.name == "picker.discovery"] == []
    assert endpoints(published) == ["10.1.0.1:8000"]
    cluster.create_pod("leader-b")
    cluster.set_ready("leader-b", "10.1.0.2")
    wait_until(lambda: endpoints(published) == ["10.1.0.1:8000", "10.1.0.2:8000"], BOUND,
               "a change after the relist")
