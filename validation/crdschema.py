"""Custom resources: validate against the pinned CRDs' openAPIV3Schema.

Each CRD file is converted once into JSON Schema (strict: unknown fields are errors) and cached
under the cache directory keyed by the file's SHA-256, for both this validator and kubeconform.
Before validation the schema's defaults are applied (as the API server does), then the schema,
the list-map key uniqueness and the CEL rules are checked.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import yaml
from jsonschema import Draft4Validator, FormatChecker, ValidationError, validators

from validation import cel_rules

try:
    _Loader = yaml.CSafeLoader
except AttributeError:  # pragma: no cover
    _Loader = yaml.SafeLoader

CONVERTER_VERSION = "3"   # bump when convert() changes, to invalidate the cache


# ---------------------------------------------------------------- conversion

def convert(node, root: bool = False):
    """openAPIV3Schema -> JSON Schema (draft 4 vocabulary), strict."""
    if isinstance(node, list):
        return [convert(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {k: convert(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[key] = convert(value)
        elif key == "nullable":
            continue
        else:
            out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    strict = (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
              and not node.get("x-kubernetes-preserve-unknown-fields"))
    if strict:
        out["additionalProperties"] = False
    if root:
        props = out.setdefault("properties", {})
        props["apiVersion"] = {"type": "string"}
        props["kind"] = {"type": "string"}
        props["metadata"] = {"type": "object"}   # checked against ObjectMeta separately
        out["type"] = "object"
        out["additionalProperties"] = False
    return out


def for_kubeconform(schema: dict) -> dict:
    """The converted schema as kubeconform reads it (draft 4, no Kubernetes extensions)."""
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node
    return {"$schema": "http://json-schema.org/draft-04/schema#", **strip(schema)}


# ---------------------------------------------------------------- validation keywords

def _cel_keyword(validator, rules, instance, schema):
    for rule in rules:
        message = cel_rules.evaluate(rule, instance, schema)
        if message is not None:
            yield ValidationError(message)


def _list_map_keys(validator, keys, instance, schema):
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen = {}
    for index, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key))
            yield ValidationError(f"duplicate entry ({shown}) at [{seen[key]}] and [{index}]")
        seen[key] = index


_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
FORMATS = FormatChecker()


@FORMATS.checks("int32")
def _int32(value):
    return not isinstance(value, int) or -2**31 <= value < 2**31


@FORMATS.checks("int64")
def _int64(value):
    return not isinstance(value, int) or -2**63 <= value < 2**63


@FORMATS.checks("duration")
def _duration(value):
    return not isinstance(value, str) or bool(_DURATION.match(value))


CRValidator = validators.extend(Draft4Validator, {
    "x-kubernetes-validations": _cel_keyword,
    "x-kubernetes-list-map-keys": _list_map_keys,
})


def apply_defaults(value, schema: dict):
    """Fill in `default`s like the API server does (in place); returns the value."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(value[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in props:
                    apply_defaults(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


# ---------------------------------------------------------------- CRD directory + cache

class CRDStore:
    """Index of the CRD directory: (group, version, kind) -> converted schema (cached on disk)."""

    def __init__(self, crds_dir: Path, cache_dir: Path, extra_dirs: tuple[Path, ...] = ()):
        """extra_dirs: further CRD folders (those `make crds` fetches from Go modules)."""
        self.crds_dir = crds_dir
        self.cache_dir = cache_dir / "crd-schemas"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.index: dict[tuple[str, str, str], Path] = {}
        self.problems: list[str] = []
        self._schemas: dict[Path, dict] = {}
        self._validators: dict[Path, CRValidator] = {}
        if not crds_dir.is_dir():
            raise SystemExit(f"CRD directory {crds_dir} does not exist (run `make crds` or set CRDS_DIR)")
        for extra in extra_dirs:
            if not extra.is_dir():
                raise SystemExit(f"CRD directory {extra} does not exist (run `make crds`)")
        for folder in (crds_dir, *extra_dirs):
            for path in sorted(folder.rglob("*.y*ml")):
                self._add_file(path)

    def _add_file(self, path: Path) -> None:
        data = path.read_bytes()
        digest = hashlib.sha256(data + CONVERTER_VERSION.encode()).hexdigest()[:20]
        folder = self.cache_dir / digest
        manifest = folder / "index.json"
        if not manifest.is_file():
            entries = self._convert_file(path, data, folder)
            folder.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps(entries))
        for entry in json.loads(manifest.read_text()):
            self.index[(entry["group"], entry["version"], entry["kind"])] = folder / entry["file"]

    def _convert_file(self, path: Path, data: bytes, folder: Path) -> list[dict]:
        entries = []
        try:
            docs = list(yaml.load_all(data, Loader=_Loader))
        except yaml.YAMLError as err:
            self.problems.append(f"{path}: invalid YAML: {err}")
            return entries
        folder.mkdir(parents=True, exist_ok=True)
        for doc in docs:
            if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            group, kind = spec["group"], spec["names"]["kind"]
            for version in spec.get("versions", []):
                raw = ((version.get("schema") or {}).get("openAPIV3Schema"))
                if raw is None:
                    continue
                converted = convert(raw, root=True)
                name = f"{group}_{kind}_{version['name']}".lower()
                (folder / f"{name}.json").write_text(json.dumps(converted))
                (folder / f"{name}.kubeconform.json").write_text(json.dumps(for_kubeconform(converted)))
                entries.append({"group": group, "version": version["name"], "kind": kind,
                                "file": f"{name}.json"})
        return entries

    def has(self, api_version: str, kind: str) -> bool:
        return self._key(api_version, kind) in self.index

    @staticmethod
    def _key(api_version: str, kind: str):
        group, _, version = api_version.rpartition("/")
        return (group, version, kind)

    def schema_file(self, api_version: str, kind: str) -> Path:
        return self.index[self._key(api_version, kind)]

    def schema(self, api_version: str, kind: str) -> dict:
        path = self.schema_file(api_version, kind)
        if path not in self._schemas:
            self._schemas[path] = json.loads(path.read_text())
        return self._schemas[path]

    def kubeconform_file(self, api_version: str, kind: str) -> Path:
        return self.schema_file(api_version, kind).with_suffix(".kubeconform.json")

    def validate(self, obj: dict):
        """Schema errors for a custom resource, after applying the CRD's defaults."""
        path = self.schema_file(obj["apiVersion"], obj["kind"])
        schema = self.schema(obj["apiVersion"], obj["kind"])
        if path not in self._validators:
            self._validators[path] = CRValidator(schema, format_checker=FORMATS)
        defaulted = apply_defaults(copy.deepcopy(obj), schema)
        return self._validators[path].iter_errors(defaulted)

    def kinds(self) -> list[tuple[str, str, str]]:
        return sorted(self.index)
