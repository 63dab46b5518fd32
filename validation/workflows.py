"""GitHub workflow files against check-jsonschema's vendored schema (no network needed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from validation.problems import Problem


def check(root: Path) -> list[Problem]:
    folder = root / ".github" / "workflows"
    files = sorted([*folder.glob("*.yml"), *folder.glob("*.yaml")]) if folder.is_dir() else []
    if not files:
        return [Problem(".github/workflows", "no workflow files found", source="workflows")]
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           "--disable-formats", "*", "-o", "text", *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return []
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return [Problem(".github/workflows", "\n    ".join(lines), source="workflows")]
