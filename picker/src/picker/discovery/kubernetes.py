"""Kubernetes discovery: the InferencePool, the pods it selects, and the namespace's
InferenceObjectives and InferenceModelRewrites, each kept by a list+watch loop.

Every watch event, live or replayed by a test, goes through ResourceWatch.run_once ->
PoolState.apply. A watch that expires (410 Gone, as an ERROR event or an ApiException) is
answered by a fresh list; other errors back off and retry. The kubernetes client is synchronous,
so each watch runs in a thread and PoolState.publish hands results to a callback.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from picker.discovery.objects import (ObjectError, Objective, Rewrite, parse_objective,
                                      parse_rewrite)

log = logging.getLogger("picker.discovery")
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
LLMD_GROUP, LLMD_VERSION = "llm-d.ai", "v1alpha2"
OBJECTIVE_PLURAL, REWRITE_PLURAL = "inferenceobjectives", "inferencemodelrewrites"

Publish = Callable[[list[str], list[Objective], list[Rewrite]], None]


class WatchExpired(Exception):
    """410 Gone: the resourceVersion is too old; list again."""


def _name(obj: dict[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("name", "")


def _rv(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def pod_ready(pod: dict[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") not in (None, "Running"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


@dataclass
class PoolState:
    """What the watches have seen; publish() turns it into endpoints and objects."""
    pool_name: str
    publish_fn: Publish
    pool: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    objectives: dict[str, dict[str, Any]] = field(default_factory=dict)
    rewrites: dict[str, dict[str, Any]] = field(default_factory=dict)
    synced: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _store(self, kind: str) -> dict[str, dict[str, Any]]:
        return {"pods": self.pods, "objectives": self.objectives, "rewrites": self.rewrites}[kind]

    def reset(self, kind: str, items: Iterable[dict[str, Any]]) -> None:
        with self.lock:
            if kind == "pool":
                self.pool = next((i for i in items if _name(i) == self.pool_name), None)
            else:
                store = self._store(kind)
                store.clear()
                store.update({_name(i): i for i in items})
            self.synced.add(kind)
        self.publish()

    def apply(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        with self.lock:
            if kind == "pool":
                if _name(obj) == self.pool_name:
                    self.pool = None if event_type == "DELETED" else obj
            elif event_type == "DELETED":
                self._store(kind).pop(_name(obj), None)
            else:
                self._store(kind)[_name(obj)] = obj
        self.publish()

    @property
    def is_synced(self) -> bool:
        return self.synced >= {"pool", "pods", "objectives", "rewrites"}

    def endpoints(self) -> list[str]:
        pool = self.pool
        if pool is None:
            return []
        spec = pool.get("spec") or {}
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = [p.get("number") for p in spec.get("targetPorts") or [] if p.get("number")]
        if not selector or not ports:
            return []
        out = []
        for pod in sorted(self.pods.values(), key=_name):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if all(labels.get(k) == v for k, v in selector.items()) and pod_ready(pod):
                ip = pod["status"]["podIP"]
                host = f"[{ip}]" if ":" in ip else ip
                out.extend(f"{host}:{port}" for port in ports)
        return out

    def _objects(self) -> tuple[list[Objective], list[Rewrite]]:
        objectives, rewrites = [], []
        for kind, store, parse, out in (("objectives", self.objectives, parse_objective, objectives),
                                        ("rewrites", self.rewrites, parse_rewrite, rewrites)):
            for obj in store.values():
                try:
                    parsed = parse(obj, "cluster")
                except ObjectError as exc:
                    log.error("ignoring invalid object", extra={"error": str(exc)})
                    continue
                if parsed.pool in (None, self.pool_name):
                    out.append(parsed)
        return objectives, rewrites

    def publish(self) -> None:
        with self.lock:
            endpoints = self.endpoints()
            objectives, rewrites = self._objects()
        self.publish_fn(endpoints, objectives, rewrites)


ListFn = Callable[[], tuple[list[dict[str, Any]], str | None]]
WatchFn = Callable[[str | None], Iterator[dict[str, Any]]]


class ResourceWatch:
    def __init__(self, kind: str, state: PoolState, list_fn: ListFn, watch_fn: WatchFn):
        self.kind, self.state, self.list_fn, self.watch_fn = kind, state, list_fn, watch_fn
        self.resource_version: str | None = None
        self.relists = 0

    def relist(self) -> None:
        items, self.resource_version = self.list_fn()
        self.relists += 1
        self.state.reset(self.kind, items)

    def run_once(self) -> int:
        """Consume one watch stream from the current resourceVersion (listing first if needed).

        Returns the number of events when the stream ends; raises WatchExpired on 410 (the
        caller lists again).
        """
        if self.resource_version is None:
            self.relist()
        events = 0
        for event in self.watch_fn(self.resource_version):
            events += 1
            etype = event.get("type")
            obj = event.get("raw_object") or event.get("object")
            if not isinstance(obj, dict):
                continue
            if etype == "ERROR":
                if obj.get("code") == 410:
                    raise WatchExpired(obj.get("message", "410 Gone"))
                raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message')}")
            self.resource_version = _rv(obj) or self.resource_version
            if etype == "BOOKMARK":
                continue
            if etype in ("ADDED", "MODIFIED", "DELETED"):
                self.state.apply(self.kind, etype, obj)
        return events

    def run(self, stop: threading.Event, backoff: float = 1.0) -> None:
        from kubernetes.client.exceptions import ApiException
        while not stop.is_set():
            try:
                started = time.monotonic()
                if self.run_once() == 0 and time.monotonic() - started < 1.0:
                    stop.wait(backoff)  # an API server ending empty watches at once: no hot loop
            except WatchExpired:
                self.resource_version = None
            except ApiException as exc:
                if exc.status == 410:
                    self.resource_version = None
                    continue
                log.warning("watch failed", extra={"kind": self.kind, "error": str(exc)[:300]})
                stop.wait(backoff)
            except Exception as exc:  # noqa: BLE001 - keep watching whatever the API did
                log.warning("watch failed", extra={"kind": self.kind, "error": repr(exc)[:300]})
                self.resource_version = None
                stop.wait(backoff)


def load_config() -> None:
    """The client's credentials: in-cluster, else the kubeconfig."""
    from kubernetes import config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG read now: the client reads it once at import time otherwise.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


def api_watches(state: PoolState, namespace: str, timeout_seconds: int = 300) -> list[ResourceWatch]:
    """The four list+watch loops against the real API server (in-cluster config or kubeconfig)."""
    import json

    from kubernetes import client, watch

    load_config()
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()

    def custom_list(group: str, version: str, plural: str) -> ListFn:
        def fn():
            out = custom.list_namespaced_custom_object(group, version, namespace, plural)
            return out.get("items", []), (out.get("metadata") or {}).get("resourceVersion")
        return fn

    def custom_watch(group: str, version: str, plural: str) -> WatchFn:
        def fn(rv):
            return watch.Watch().stream(custom.list_namespaced_custom_object, group, version,
                                        namespace, plural, resource_version=rv,
                                        timeout_seconds=timeout_seconds, allow_watch_bookmarks=True)
        return fn

    def pod_list():
        resp = core.list_namespaced_pod(namespace, _preload_content=False)
        out = json.loads(resp.data)
        return out.get("items", []), (out.get("metadata") or {}).get("resourceVersion")

    def pod_watch(rv):
        return watch.Watch().stream(core.list_namespaced_pod, namespace, resource_version=rv,
                                    timeout_seconds=timeout_seconds, allow_watch_bookmarks=True)

    return [
        ResourceWatch("pool", state, custom_list(POOL_GROUP, POOL_VERSION, POOL_PLURAL),
                      custom_watch(POOL_GROUP, POOL_VERSION, POOL_PLURAL)),
        ResourceWatch("pods", state, pod_list, pod_watch),
        ResourceWatch("objectives", state, custom_list(LLMD_GROUP, LLMD_VERSION, OBJECTIVE_PLURAL),
                      custom_watch(LLMD_GROUP, LLMD_VERSION, OBJECTIVE_PLURAL)),
        ResourceWatch("rewrites", state, custom_list(LLMD_GROUP, LLMD_VERSION, REWRITE_PLURAL),
                      custom_watch(LLMD_GROUP, LLMD_VERSION, REWRITE_PLURAL)),
    ]


def start_threads(watches: list[ResourceWatch], stop: threading.Event) -> list[threading.Thread]:
    threads = []
    for w in watches:
        t = threading.Thread(target=w.run, args=(stop,), name=f"watch-{w.kind}", daemon=True)
        t.start()
        threads.append(t)
    return threads
