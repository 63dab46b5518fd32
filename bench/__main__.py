"""`python -m bench [NAME ...]`: run benchmarks, then write their sections of BENCHMARKS.md.

    python -m bench                 # all of them (what `make bench` runs), then the report
    python -m bench validation      # one benchmark (their list: bench/registry.py, or --help);
                                    # rewrites its own section only
    python -m bench report          # rewrite BENCHMARKS.md from results/bench/*.json
    python -m bench report --only validation picker   # rewrite just those sections

A section whose results are missing from results/bench/ keeps its text from the current
BENCHMARKS.md: a checkout without results (results/ is not in git) loses no figure.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from bench import report
from bench.registry import BENCHMARKS, BY_NAME


def sections_to_write(names: list[str], only: list[str] | None, failed: list[str]) -> list[str] | None:
    """Which benchmarks' sections the report rewrites (None: every one with results): those named
    by --only; with `report`, every one; else those that ran now and did not fail (results left
    in results/bench/ by an earlier run are not passed off as this run's)."""
    if only is not None:
        return only
    if "report" in names:
        return None
    return [n for n in (names or BY_NAME) if n not in failed]


def main(argv: list[str] | None = None) -> int:
    width = max(len(b.name) for b in BENCHMARKS) + 1
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="benchmarks:\n" + "\n".join(f"  {b.name:{width}} {b.about}" for b in BENCHMARKS))
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"{' | '.join(BY_NAME)} | report (default: all, then report)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(BY_NAME),
                   help="rewrite only these benchmarks' sections (default: the benchmarks run now; "
                   "with `report` alone: every benchmark with results)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="lab seeds")
    p.add_argument("--seed", type=int, default=0, help="workload seed of the crosscheck")
    p.add_argument("--soak-seconds", type=float, default=180.0, help="how long the soak runs abuse rounds")
    p.add_argument("--matrix-args", default="", help="more options of `python -m lab matrix`, "
                   "e.g. \"--jobs 3 --resume\"")
    p.add_argument("--speedup", type=float, help="crosscheck simulator speedup (default: the demo's)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BY_NAME and n != "report"]
    if unknown:
        p.error(f"unknown benchmark {' '.join(unknown)}; known: {' '.join(BY_NAME)} report")
    names = args.names or list(BY_NAME)
    failed = []
    for name in names:
        if name == "report":
            continue
        started = time.monotonic()
        print(f"== bench {name}", flush=True)
        try:
            BY_NAME[name].run(args)
        except Exception as e:  # one broken benchmark must not lose the others' results
            failed.append(name)
            traceback.print_exc()
            print(f"bench {name} FAILED: {e}", file=sys.stderr, flush=True)
        print(f"== bench {name}: {time.monotonic() - started:.0f} s", flush=True)
    report.write(sections_to_write(args.names, args.only, failed))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
