"""The picker as deployed (`python -m picker --discovery kubernetes`) with a ServiceAccount token bound
to exactly the Role in base/picker, on an API server with RBAC authorization: it syncs and its
readiness and endpoint set follow the leader pods; without one of the Role's rules it never gets
ready; and the token can do nothing beyond reading what discovery watches and holding its Lease
(tests/apiserver/test_picker_leader_election.py runs the pickers with --leader-election)."""
from __future__ import annotations

import copy

import pytest

from tests.apiserver.test_discovery import BOUND, Cluster, leader_labels
from tests.helpers.kube import NAMESPACE, PICKER, POOL, ROOT, STARTUP, Picker, wait_until
from validation.apiserver import ServerSideApply, ensure_namespaces, render_targets
from validation.cli import default_crds_dir

LEASE = "reasoning-pool-picker"   # --leader-election's Lease (base/picker/rbac.yaml)


@pytest.fixture(scope="module")
def deployed(control_plane):
    """overlays/a10's picker ServiceAccount/Role/RoleBinding and inference objects, applied for real."""
    admin = control_plane.api_client()
    objs = render_targets(ROOT, default_crds_dir(ROOT).resolve(), ["overlays/a10"])["overlays/a10"].objects
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    ensure_namespaces(admin, [NAMESPACE])
    sa = ServerSideApply(admin)
    sa.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NAMESPACE}},
             dry_run=False)
    for key in (("ServiceAccount", PICKER), ("RoleBinding", PICKER), ("InferencePool", POOL),
                ("InferenceObjective", "batch"), ("InferenceObjective", "interactive"),
                ("InferenceModelRewrite", "qwq")):
        sa.apply(by_key[key], dry_run=False)
    return by_key


@pytest.fixture(scope="module")
def picker_token(control_plane, deployed):
    from kubernetes import client
    core = client.CoreV1Api(control_plane.api_client())
    review = core.create_namespaced_service_account_token(PICKER, NAMESPACE, {"spec": {"expirationSeconds": 3600}})
    return review.status.token


def apply_role(admin, role):
    ServerSideApply(admin).apply(role, dry_run=False)




def test_picker_does_its_job_with_exactly_the_role(control_plane, deployed, picker_token, tmp_path):
    admin = control_plane.api_client()
    role = deployed[("Role", PICKER)]
    without_rewrites = copy.deepcopy(role)
    without_rewrites["rules"] = [r for r in role["rules"] if "inferencemodelrewrites" not in r["resources"]] + \
        [{"apiGroups": ["llm-d.ai"], "resources": ["inferenceobjectives"], "verbs": ["get", "list", "watch"]}]
    apply_role(admin, without_rewrites)
    cluster = Cluster(admin, NAMESPACE, leader_labels(deployed))
    cluster.create_pod("qwq-dist-v1-0")
    cluster.set_ready("qwq-dist-v1-0", "10.2.0.1")
    picker = Picker(control_plane.kubeconfig(tmp_path / "kubeconfig", picker_token, NAMESPACE),
                    tmp_path / "picker.log")
    try:
        wait_until(lambda: picker.serving() is not None, STARTUP, "the picker's health server")
        # One rule short: the rewrites watch is forbidden, discovery never syncs, never ready.
        wait_until(lambda: any("forbidden" in r.get("error", "").lower() and r.get("kind") == "rewrites"
                               for r in picker.log()), BOUND, "the forbidden rewrites watch is logged")
        assert picker.serving() is False
        # Exactly the Role: ready, with the pool's one ready leader.
        apply_role(admin, role)
        took = wait_until(lambda: picker.serving() is True, BOUND, "picker ready with the Role")
        print(f"\npicker ready {took:.2f}s after the Role was complete")
        ready_at = len(picker.log())
        assert picker.endpoints() == ["10.2.0.1:8000"]
        cluster.set_ready("qwq-dist-v1-0", "10.2.0.1", ready=False)
        wait_until(lambda: picker.serving() is False, BOUND, "not ready without a ready leader")
        cluster.create_pod("qwq-dist-v1-1")
        cluster.set_ready("qwq-dist-v1-1", "10.2.0.2")
        cluster.set_ready("qwq-dist-v1-0", "10.2.0.1")
        wait_until(lambda: picker.serving() is True and picker.endpoints() == ["10.2.0.1:8000", "10.2.0.2:8000"],
                   BOUND, "both leaders")
        cluster.delete("qwq-dist-v1-0")
        wait_until(lambda: picker.endpoints() == ["10.2.0.2:8000"], BOUND, "deleted leader gone")
        # Every watch works from then on (a Role without `watch` would still list, and be ready).
        assert [r for r in picker.log()[ready_at:] if r.get("msg") == "watch failed"] == []
    finally:
        picker.stop()
        for name in ("qwq-dist-v1-0", "qwq-dist-v1-1"):
            try:
                cluster.delete(name)
            except Exception:  # noqa: BLE001 - already gone
                pass


# What the picker's token may do in its namespace besides what every authenticated user may do
# (the self-review APIs): exactly the Role's rules.
SELF_REVIEWS = {("authorization.k8s.io", "selfsubjectaccessreviews"), ("authorization.k8s.io", "selfsubjectrulesreviews"),
                ("authentication.k8s.io", "selfsubjectreviews")}


def test_the_token_can_do_nothing_more(control_plane, deployed, picker_token):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    apply_role(control_plane.api_client(), deployed[("Role", PICKER)])
    api = control_plane.api_client(picker_token)
    review = client.AuthorizationV1Api(api).create_self_subject_rules_review(
        {"spec": {"namespace": NAMESPACE}})
    granted = {(g, r, v) for rule in review.status.resource_rules for g in rule.api_groups or [""]
               for r in rule.resources or [] for v in rule.verbs
               if (g, r) not in SELF_REVIEWS}
    role = {(g, r, v) for rule in deployed[("Role", PICKER)]["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}
    assert granted == role

    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    coordination = client.CoordinationV1Api(api)
    assert core.list_namespaced_pod(NAMESPACE).items is not None           # what it needs works
    custom.get_namespaced_custom_object("inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools", POOL)
    forbidden = {
        "read Secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "read ConfigMaps": lambda: core.list_namespaced_config_map(NAMESPACE),
        "pods in another namespace": lambda: core.list_namespaced_pod("default"),
        "pods cluster-wide": lambda: core.list_pod_for_all_namespaces(),
        "create a pod": lambda: core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": "x"}, "spec": {"containers": [{"name": "x", "image": "x:1"}]}}),
        "delete pods": lambda: core.delete_collection_namespaced_pod(NAMESPACE),
        "patch a pod's status": lambda: core.patch_namespaced_pod_status("x", NAMESPACE, {"status": {}}),
        "change the pool": lambda: custom.patch_namespaced_custom_object(
            "inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools", POOL, {"metadata": {"labels": {"a": "b"}}}),
        "delete an objective": lambda: custom.delete_namespaced_custom_object(
            "llm-d.ai", "v1alpha2", NAMESPACE, "inferenceobjectives", "batch"),
        "pools cluster-wide": lambda: custom.list_cluster_custom_object("inference.networking.k8s.io", "v1",
                                                                         "inferencepools"),
        "read its Role": lambda: client.RbacAuthorizationV1Api(api).read_namespaced_role(PICKER, NAMESPACE),
        "mint tokens": lambda: core.create_namespaced_service_account_token(PICKER, NAMESPACE, {"spec": {}}),
        # the Lease of --leader-election: its own only (create cannot be limited by name)
        "read another Lease": lambda: coordination.read_namespaced_lease("other", NAMESPACE),
        "update another Lease": lambda: coordination.replace_namespaced_lease("other", NAMESPACE, {
            "metadata": {"name": "other"}, "spec": {}}),
        "delete its Lease": lambda: coordination.delete_namespaced_lease(LEASE, NAMESPACE),
        "list Leases": lambda: coordination.list_namespaced_lease(NAMESPACE),
        "Leases in another namespace": lambda: coordination.create_namespaced_lease("default", {
            "metadata": {"name": LEASE}, "spec": {}}),
    }
    allowed = []
    for what, call in forbidden.items():
        try:
            call()
            allowed.append(what)
        except ApiException as exc:
            if exc.status != 403:
                allowed.append(f"{what} ({exc.status})")
    assert allowed == []
