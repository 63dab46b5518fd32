"""The argocd-cm health checks run in a real Lua runtime (lupa) against status samples."""
from __future__ import annotations

import pytest
from lupa import LuaRuntime

from tests.policy.conftest import find, rendered

LWS_KEY = "resource.customizations.health.leaderworkerset.x-k8s.io_LeaderWorkerSet"
APP_KEY = "resource.customizations.health.argoproj.io_Application"
NOW = "2026-12-02T12:00:00Z"
NOW_EPOCH = 1796212800   # NOW as Unix time


def argocd_cm():
    return find(rendered("argocd/config"), "ConfigMap", "argocd-cm")["data"]


def run_health(script: str, obj: dict, now: int = NOW_EPOCH) -> dict:
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.execute(f"os.time = function() return {now} end")   # a fixed clock instead of the wall clock
    lua.globals().obj = to_lua(lua, obj)
    result = lua.execute(script)
    return {"status": result["status"], "message": result["message"]}


def to_lua(lua, value):
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value])
    return value


def lws(replicas=3, generation=2, status=None):
    obj = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "qwq-dist-v1", "generation": generation}, "spec": {"replicas": replicas}}
    if status is not None:
        obj["status"] = status
    return obj


def cond(ctype, status, reason="", message="", at="2026-12-02T11:50:00Z"):
    return {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": at}


SAMPLES = [
    ("no status yet", lws(), "Progressing"),
    ("spec not observed", lws(status={"observedGeneration": 1, "readyReplicas": 3, "updatedReplicas": 3,
                                      "conditions": [cond("Available", "True")]}), "Progressing"),
    ("all groups ready", lws(status={"observedGeneration": 2, "readyReplicas": 3, "updatedReplicas": 3,
                                     "replicas": 3, "conditions": [cond("Available", "True", "AllGroupsReady"),
                                                                   cond("Progressing", "False")]}), "Healthy"),
    ("loading weights for 10 min", lws(status={"observedGeneration": 2, "readyReplicas": 1, "updatedReplicas": 3,
                                               "conditions": [cond("Progressing", "True", "GroupsProgressing"),
                                                              cond("Available", "False")]}), "Progressing"),
    ("rolling update", lws(status={"observedGeneration": 2, "readyReplicas": 3, "updatedReplicas": 1,
                                   "conditions": [cond("Available", "True"),
                                                  cond("UpdateInProgress", "True", "GroupsUpdating")]}),
     "Progressing"),
    ("stuck for 3 h (crash loop)", lws(status={"observedGeneration": 2, "readyReplicas": 2, "updatedReplicas": 3,
                                               "conditions": [cond("Progressing", "True", at="2026-12-02T09:00:00Z")]}),
     "Degraded"),
    ("not ready, not progressing", lws(status={"observedGeneration": 2, "readyReplicas": 1, "updatedReplicas": 3,
                                               "conditions": [cond("Available", "False"),
                                                              cond("Progressing", "False")]}), "Degraded"),
    ("explicit Failed condition", lws(status={"observedGeneration": 2, "readyReplicas": 0,
                                              "conditions": [cond("Failed", "True", message="group 1 failed")]}),
     "Degraded"),
    ("scaled to zero", lws(replicas=0, status={"observedGeneration": 2, "readyReplicas": 0, "updatedReplicas": 0,
                                               "conditions": [cond("Available", "True")]}), "Healthy"),
]


@pytest.mark.parametrize("name,obj,expected", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_leaderworkerset_health(name, obj, expected):
    result = run_health(argocd_cm()[LWS_KEY], obj)
    assert result["status"] == expected, result
    assert result["message"]


def test_stuck_message_names_duration_and_counts():
    obj = SAMPLES[5][1]
    assert run_health(argocd_cm()[LWS_KEY], obj)["message"] == \
        "Groups not ready after 180 min (2/3 groups ready, 3 updated)"


def test_lws_check_has_open_libs_for_the_clock():
    assert argocd_cm()["resource.customizations.useOpenLibs.leaderworkerset.x-k8s.io_LeaderWorkerSet"] == "true"


@pytest.mark.parametrize("health,expected", [(None, "Progressing"), ({"status": "Degraded", "message": "x"}, "Degraded"),
                                             ({"status": "Healthy"}, "Healthy")])
def test_application_health(health, expected):
    app = {"kind": "Application", "metadata": {"name": "lws"}, "status": {}}
    if health:
        app["status"]["health"] = health
    assert run_health(argocd_cm()[APP_KEY], app)["status"] == expected
