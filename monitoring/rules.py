"""`python -m monitoring.rules check|test`: promtool over the PrometheusRule in components/monitoring.

promtool reads plain rule files, so the PrometheusRule's `spec` (its `groups`) is written to
`<work>/inference-alerts.rules.yaml` first; `test` copies monitoring/rules-test.yaml beside it.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "components/monitoring/rules.yaml"
TESTS = REPO / "monitoring/rules-test.yaml"
RULE_FILE = "inference-alerts.rules.yaml"


def rule_groups(path: Path = RULES) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    groups = [g for d in docs if d.get("kind") == "PrometheusRule" for g in d["spec"]["groups"]]
    if not groups:
        raise SystemExit(f"{path}: no PrometheusRule with spec.groups")
    return groups


def alerts(path: Path = RULES) -> list[dict]:
    return [r for g in rule_groups(path) for r in g["rules"] if "alert" in r]


def write_rule_file(work: Path, path: Path = RULES) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    out = work / RULE_FILE
    out.write_text(yaml.safe_dump({"groups": rule_groups(path)}, sort_keys=False))
    return out


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        raise SystemExit("promtool not found (Debian package `prometheus`; `make tools` installs it)")
    return subprocess.run([exe, *args], capture_output=True, text=True)


def check(work: Path, path: Path = RULES) -> subprocess.CompletedProcess:
    return promtool("check", "rules", str(write_rule_file(work, path)))


def test(work: Path, path: Path = RULES, tests: Path = TESTS) -> subprocess.CompletedProcess:
    write_rule_file(work, path)
    shutil.copyfile(tests, work / tests.name)
    return promtool("test", "rules", str(work / tests.name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monitoring.rules", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["check", "test"])
    p.add_argument("--work", type=Path, default=REPO / ".cache/monitoring")
    args = p.parse_args(argv)
    proc = check(args.work) if args.command == "check" else test(args.work)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        print(f"promtool {args.command} rules FAILED for {RULES.relative_to(REPO)}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
