"""One reported problem: where (render target, object, field path) and what."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    target: str          # overlay / app path / file the problem was found in
    message: str
    obj: str = ""        # "Kind namespace/name" or "Kind name"
    path: str = ""       # field path inside the object, e.g. spec.rules[0].weight
    source: str = "schema"

    def __str__(self) -> str:
        where = self.target
        if self.obj:
            where += f": {self.obj}"
        if self.path:
            where += f": {self.path}"
        return f"[{self.source}] {where}: {self.message}"


def describe(obj: dict) -> str:
    """`Kind namespace/name` (or `Kind name` for cluster-scoped objects) of a manifest."""
    if not isinstance(obj, dict):
        return "<not an object>"
    meta = obj.get("metadata") or {}
    kind = obj.get("kind", "<no kind>")
    name = meta.get("name", "<no name>") if isinstance(meta, dict) else "<bad metadata>"
    ns = meta.get("namespace") if isinstance(meta, dict) else None
    return f"{kind} {ns}/{name}" if ns else f"{kind} {name}"


def format_path(parts) -> str:
    """JSON path parts -> `spec.rules[0].backendRefs[1].weight`."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
