"""Built-in Kubernetes kinds: strict JSON schemas bundled with kubernetes-validate.

`_definitions.json` is loaded once into a `referencing.Registry`; one validator per definition is
built lazily (kubernetes_validate.validate() reloads the file on every call and stops at the first
error).
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import kubernetes_validate
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

DEFS_ID = "https://kubernetes.io/api/_definitions.json"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def schema_dir(k8s_version: str) -> Path:
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    path = base / f"v{k8s_version}-local-strict"
    if not path.is_dir():
        versions = sorted(p.name for p in base.iterdir() if p.name.endswith("-local-strict"))
        raise SystemExit(f"kubernetes-validate has no schemas for {k8s_version}; available: {versions}")
    return path


class BuiltinSchemas:
    def __init__(self, k8s_version: str):
        self.k8s_version = k8s_version
        self.defs = json.loads((schema_dir(k8s_version) / "_definitions.json").read_text())["$defs"]
        self._validators: dict[str, Draft202012Validator] = {}

    @cached_property
    def registry(self) -> Registry:
        document = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": DEFS_ID, "$defs": self.defs}
        return Registry().with_resource(DEFS_ID, Resource.from_contents(document))

    @cached_property
    def by_gvk(self) -> dict[tuple[str, str, str], str]:
        index = {}
        for name, definition in self.defs.items():
            for gvk in definition.get("x-kubernetes-group-version-kind", []):
                key = (gvk.get("group", ""), gvk["version"], gvk["kind"])
                # Prefer the definition named after the kind (not e.g. a *List or DeleteOptions).
                if key not in index or name.endswith("." + gvk["kind"]):
                    index[key] = name
        return index

    def definition_for(self, api_version: str, kind: str) -> str | None:
        group, _, version = api_version.rpartition("/")
        return self.by_gvk.get((group, version, kind))

    def validator(self, definition: str) -> Draft202012Validator:
        if definition not in self._validators:
            schema = {"$ref": f"{DEFS_ID}#/$defs/{definition}"}
            self._validators[definition] = Draft202012Validator(schema, registry=self.registry)
        return self._validators[definition]

    def standalone(self, definition: str) -> dict:
        """A self-contained schema (only the $defs it reaches) for kubeconform's local files."""
        needed, todo = set(), [definition]
        while todo:
            name = todo.pop()
            if name in needed:
                continue
            needed.add(name)
            todo.extend(_refs(self.defs[name]))
        return {"$schema": "https://json-schema.org/draft/2020-12/schema",
                "$ref": f"#/$defs/{definition}",
                "$defs": {name: self.defs[name] for name in sorted(needed)}}


def _refs(node) -> list[str]:
    found = []
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and "#/$defs/" in ref:
            found.append(ref.split("#/$defs/", 1)[1])
        for value in node.values():
            found.extend(_refs(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_refs(value))
    return found
