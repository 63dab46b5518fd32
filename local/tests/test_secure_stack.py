"""The local stack's secure parts without starting anything: the throw-away CA and certificates,
the Secrets they fill, the rate limit service's wiring (local/certs.py, local/ratelimit.py)."""
from __future__ import annotations

import base64

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from local import certs, dataplane, ratelimit
from local.stack.config import StackConfig, StackError
from local.stack.topology import topology


def _load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_run_certificates_chain_to_the_run_ca(tmp_path):
    run = certs.write_run_certs(tmp_path)
    ca = _load(run.ca)
    for folder, name in ((run.gateway, "localhost"), (run.picker, certs.PICKER_NAME)):
        leaf = _load(folder / "tls.crt")
        ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(leaf.signature_hash_algorithm))
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert name in sans.get_values_for_type(x509.DNSName)
        assert (folder / "tls.key").stat().st_mode & 0o777 == 0o600
    other = certs.write_run_certs(tmp_path / "other")  # another run: another CA
    assert _load(other.ca).public_key().public_numbers() != ca.public_key().public_numbers()


def test_secrets_fill_what_the_closed_overlay_names(tmp_path):
    topo = topology(StackConfig(name="t", run_root=tmp_path, tls=True))
    secrets = {s["metadata"]["name"]: s for s in certs.secrets_for(topo.gateway, certs.write_run_certs(tmp_path))}
    assert set(secrets) == {"inference-gateway-tls", "inference-gateway-ext-proc-tls"}
    assert set(secrets["inference-gateway-ext-proc-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert base64.b64decode(secrets["inference-gateway-ext-proc-tls"]["data"]["ca.crt"]) == (tmp_path / "ca.crt").read_bytes()
    assert all(s["metadata"]["namespace"] == "llm" for s in secrets.values())


def test_token_budget_renders_the_lua_config_map_for_envoy_gateway(tmp_path):
    topo = topology(StackConfig(name="t", run_root=tmp_path, token_budget=True))
    local = dataplane.localize(topo.gateway, {n: [("127.0.0.1", 8101)] for n in topo.services}, [("127.0.0.1", 9002)],
                               outcomes=[("127.0.0.1", 9004)])
    cm = {c["metadata"]["name"]: c for c in local if c["kind"] == "ConfigMap"}
    assert set(cm) == {"token-accounting", "budget-admission"}
    assert "envoy_on_response" in cm["token-accounting"]["data"]["lua"]
    assert "envoy_on_request" in cm["budget-admission"]["data"]["lua"]


def test_token_budget_needs_the_edge():
    with pytest.raises(StackError, match="client id"):
        StackConfig(token_budget=True, edge_security=False).components


def test_envoy_gateway_config_turns_on_the_global_rate_limit(tmp_path):
    ports = ratelimit.Ports()
    settings = {"extensionApis": {"enableLua": True}, **ratelimit.envoy_gateway_settings(ports)}
    config = dataplane.envoy_gateway_config(dataplane.Layout(tmp_path), settings)
    assert config["extensionApis"] == {"enableBackend": True, "enableLua": True, "enableEnvoyPatchPolicy": True}
    assert config["rateLimit"]["failClosed"] is True
    assert config["rateLimit"]["timeout"] == ratelimit.cluster_settings()["timeout"]  # as in the cluster
    assert dataplane.envoy_gateway_config(dataplane.Layout(tmp_path)).get("rateLimit") is None


def test_the_rate_limit_cluster_is_patched_to_the_local_service(tmp_path):
    patch = ratelimit.cluster_patch({"metadata": {"name": "inference-gateway", "namespace": "llm"}}, tmp_path,
                                    ratelimit.Ports(grpc=18191))
    ops = [p["operation"] for p in patch["spec"]["jsonPatches"]]
    assert all(p["name"] == ratelimit.CLUSTER for p in patch["spec"]["jsonPatches"])
    assert ops[0]["value"] == {"address": "127.0.0.1", "port_value": 18191}
    tls = ops[1]["value"]["typed_config"]["common_tls_context"]
    assert tls["validation_context"]["trusted_ca"]["filename"] == str(tmp_path / "envoy" / "ca.crt")
    env = ratelimit.service_env(tmp_path, ratelimit.Ports(redis=16400))
    assert env["REDIS_URL"] == "127.0.0.1:16400" and env["CONFIG_GRPC_XDS_SERVER_URL"].endswith(":18001")
