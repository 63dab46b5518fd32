"""Kubernetes discovery: watch event streams replayed through ResourceWatch.run_once/run."""
import threading

import pytest
from kubernetes.client.exceptions import ApiException

from picker.discovery.kubernetes import PoolState, ResourceWatch, WatchExpired

POOL = {"metadata": {"name": "reasoning-pool", "resourceVersion": "1"},
        "spec": {"selector": {"matchLabels": {"app": "distributed-serving", "role": "leader"}},
                 "targetPorts": [{"number": 8000}]}}


def pod(name, ip, ready=True, role="leader", rv="5", deleting=False, phase="Running"):
    meta = {"name": name, "resourceVersion": rv, "labels": {"app": "distributed-serving", "role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def ev(etype, obj):
    return {"type": etype, "raw_object": obj, "object": obj}


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, endpoints, objectives, rewrites):
        self.calls.append((endpoints, objectives, rewrites))

    @property
    def endpoints(self):
        return self.calls[-1][0]


def make(kind, lists, streams):
    """A ResourceWatch whose list/watch calls replay the given lists and event streams."""
    rec = Recorder()
    state = PoolState("reasoning-pool", rec)
    lists, streams = list(lists), list(streams)
    seen_rvs = []

    def list_fn():
        items, rv = lists.pop(0)
        return items, rv

    def watch_fn(rv):
        seen_rvs.append(rv)
        stream = streams.pop(0)
        if isinstance(stream, Exception):
            raise stream
        return iter(stream)

    return ResourceWatch(kind, state, list_fn, watch_fn), state, rec, seen_rvs


def test_pods_become_ready_unready_and_deleted():
    w, state, rec, rvs = make("pods", [([pod("a", "10.1.0.1")], "10")], [[
        ev("ADDED", pod("b", "10.1.0.2", ready=False, rv="11")),
        ev("ADDED", pod("w", "10.1.0.9", role="worker", rv="12")),
        ev("MODIFIED", pod("b", "10.1.0.2", ready=True, rv="13")),
        ev("MODIFIED", pod("a", "10.1.0.1", ready=False, rv="14")),
        ev("MODIFIED", pod("b", "10.1.0.2", deleting=True, rv="15")),
        ev("DELETED", pod("a", "10.1.0.1", rv="16")),
    ]])
    state.reset("pool", [POOL])
    w.run_once()
    history = [c[0] for c in rec.calls]
    assert history[0] == []                             # pool known, pods not listed yet
    assert ["10.1.0.1:8000"] in history
    assert ["10.1.0.1:8000", "10.1.0.2:8000"] in history  # b became ready, worker never counted
    assert history[-3:] == [["10.1.0.2:8000"], [], []]  # a unready, b terminating, a deleted
    assert rvs == ["10"] and w.resource_version == "16"


def test_410_gone_event_relists_and_resumes():
    stop = threading.Event()
    gone = ev("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})
    streams = [[ev("ADDED", pod("a", "10.1.0.1", rv="11")), gone],
               ApiException(status=410, reason="Expired"),
               [ev("ADDED", pod("c", "10.1.0.3", rv="31")), ev("BOOKMARK", {"metadata": {"resourceVersion": "40"}})]]

    lists = [([pod("a", "10.1.0.1")], "10"), ([pod("b", "10.1.0.2")], "20"), ([pod("b", "10.1.0.2")], "30")]
    w, state, rec, rvs = make("pods", lists, streams)
    state.reset("pool", [POOL])

    original = w.watch_fn
    calls = []

    def watch_then_stop(rv):
        calls.append(rv)
        if len(calls) > len(streams):  # every recorded stream replayed: end the loop
            stop.set()
            return iter([])
        return original(rv)

    w.watch_fn = watch_then_stop
    w.run(stop, backoff=0)
    assert rvs == ["10", "20", "30"]         # list 10 -> 410 event -> list 20 -> 410 exception -> list 30
    assert calls[-1] == "40"                 # the next watch resumes from the bookmark
    assert w.relists == 3
    assert rec.endpoints == ["10.1.0.2:8000", "10.1.0.3:8000"]  # a is gone after the relist
    assert w.resource_version == "40"


def test_run_once_raises_watch_expired_on_gone_event():
    w, state, _, _ = make("pods", [([], "1")], [[ev("ERROR", {"code": 410, "message": "gone"})]])
    with pytest.raises(WatchExpired):
        w.run_once()


def test_pool_changes_selector_ports_and_deletion():
    rec = Recorder()
    state = PoolState("reasoning-pool", rec)
    state.reset("pods", [pod("a", "10.1.0.1"), pod("b", "fd00::2")])
    state.apply("pool", "ADDED", POOL)
    assert rec.endpoints == ["10.1.0.1:8000", "[fd00::2]:8000"]
    two_ports = {**POOL, "spec": {**POOL["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    state.apply("pool", "MODIFIED", two_ports)
    assert len(rec.endpoints) == 4
    state.apply("pool", "ADDED", {"metadata": {"name": "other-pool"}, "spec": {}})
    assert len(rec.endpoints) == 4                      # another pool's events are ignored
    state.apply("pool", "DELETED", POOL)
    assert rec.endpoints == []


def test_objects_filtered_by_pool_and_invalid_ones_skipped():
    rec = Recorder()
    state = PoolState("reasoning-pool", rec)
    obj = lambda name, prio, pool: {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
                                    "metadata": {"name": name}, "spec": {"priority": prio, "poolRef": {"name": pool}}}
    state.reset("objectives", [obj("batch", -1, "reasoning-pool"), obj("x", 1, "other"), obj("bad", "hi", "reasoning-pool")])
    assert [o.name for o in rec.calls[-1][1]] == ["batch"]
    state.apply("objectives", "DELETED", obj("batch", -1, "reasoning-pool"))
    assert rec.calls[-1][1] == []
    rw = {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite", "metadata": {"name": "r"},
          "spec": {"poolRef": {"name": "reasoning-pool"},
                   "rules": [{"matches": [{"model": {"value": "qwq"}}], "targets": [{"modelRewrite": "qwq-2"}]}]}}
    state.apply("rewrites", "ADDED", rw)
    assert rec.calls[-1][2][0].rules[0].targets == (("qwq-2", 1.0),)
    assert not state.is_synced
    state.reset("pool", [POOL])
    state.reset("pods", [])
    state.reset("rewrites", [rw])
    assert state.is_synced
