"""The stack's throw-away API keys: made at start, one per client id in API_CLIENTS, kept in
<run_dir>/api-keys.json, and the Secret that gives them to the SecurityPolicy of the edge."""

from __future__ import annotations

import base64
import json
import os
import secrets
from pathlib import Path

from local.stack.config import API_CLIENTS, EDGE_SECURITY, StackError
from validation import manifests


def new_api_keys(path: Path) -> dict[str, str]:
    """Fresh random keys for API_CLIENTS, written to `path` readable by this user only."""
    keys = {client: secrets.token_urlsafe(32) for client in API_CLIENTS}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(keys, f, indent=2)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_TRUNC
    return keys


def read_api_keys(path: Path) -> dict[str, str]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def bearer(key: str | None) -> dict[str, str]:
    """What an OpenAI client sends with its api_key: `Authorization: Bearer <key>` (nothing without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def api_keys_secret(gateway: list[dict], keys: dict[str, str]) -> dict:
    """The Secret the SecurityPolicy's apiKeyAuth names (data key = client id, value = API key), in
    the policy's namespace: what `kubectl create secret generic` makes in a cluster."""
    policy = next((d for d in gateway if d.get("kind") == "SecurityPolicy" and (d["spec"].get("apiKeyAuth"))), None)
    if policy is None:
        raise StackError(f"edge security is on but the render has no SecurityPolicy with apiKeyAuth "
                         f"({EDGE_SECURITY} missing from the overlay?)")
    refs = policy["spec"]["apiKeyAuth"].get("credentialRefs") or []
    if len(refs) != 1 or refs[0].get("kind", "Secret") != "Secret":
        raise StackError(f"SecurityPolicy {manifests.name_of(policy)}: spec.apiKeyAuth.credentialRefs must name "
                         "one Secret for the local stack to fill")
    meta = {"name": refs[0]["name"]}
    if policy["metadata"].get("namespace"):
        meta["namespace"] = refs[0].get("namespace") or policy["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {client: base64.b64encode(key.encode()).decode() for client, key in keys.items()}}
