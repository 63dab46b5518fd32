"""Rendered manifests shared by the policy tests (rendered once per session with kubectl kustomize)."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from validation.cli import default_crds_dir
from validation.render import render

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("overlays/*/kustomization.yaml"))
NAMESPACE = "llm"
# The tests' own schema cache: `make validate` runs `python -m validation` beside this suite.
CACHE = ROOT / ".cache" / "validation-tests"


@pytest.fixture(scope="session")
def crds_dir() -> Path:
    return Path(os.environ["CRDS_DIR"]).resolve() if os.environ.get("CRDS_DIR") else default_crds_dir(ROOT)


_cache: dict[str, list] = {}


def rendered(target: str) -> list:
    """Objects of a render target; a deep copy, so tests may break them freely."""
    if target not in _cache:
        result = render(ROOT, target, default_crds_dir(ROOT))
        assert not result.problems, [str(p) for p in result.problems]
        _cache[target] = result.objects
    return copy.deepcopy(_cache[target])


def find(objs, kind, name=None):
    for o in objs:
        if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name):
            return o
    raise AssertionError(f"no {kind} {name or ''} in the rendered objects")
