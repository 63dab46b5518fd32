"""`python -m bench [NAME ...]`: run benchmarks, then write BENCHMARKS.md.

    python -m bench                 # all of them (what `make bench` runs), then the report
    python -m bench validation      # one benchmark (validation | picker | lab | matrix | crosscheck | phases |
                                    #   coldstart | demo | picker-scale | replicas | prefilter | soak |
                                    #   dead-backend)
    python -m bench report          # only rewrite BENCHMARKS.md from results/bench/*.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from bench import coldstart, crosscheck, phases, report, robustness, suites

BENCHMARKS = {
    "validation": lambda a: suites.validation(),
    "picker": lambda a: suites.picker(),
    "lab": lambda a: [suites.lab("article", a.seeds), suites.lab("shared-prefix", a.seeds)],
    "matrix": lambda a: suites.lab_matrix(a.seeds, a.matrix_args.split()),
    "crosscheck": lambda a: crosscheck.main(a.seed, a.seeds, a.speedup),
    "phases": lambda a: phases.main(a.seeds),
    "coldstart": lambda a: coldstart.main(),
    "demo": lambda a: suites.demo(),
    "picker-scale": lambda a: suites.picker_scale(),
    "replicas": lambda a: suites.replicas(a.seeds),
    "prefilter": lambda a: suites.prefilter(a.seeds),
    "soak": lambda a: robustness.soak(a.soak_seconds),
    "dead-backend": lambda a: robustness.dead_backend(),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"{' | '.join(BENCHMARKS)} | report (default: all, then report)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="lab seeds")
    p.add_argument("--seed", type=int, default=0, help="workload seed of the crosscheck")
    p.add_argument("--soak-seconds", type=float, default=180.0, help="how long the soak runs abuse rounds")
    p.add_argument("--matrix-args", default="", help="more options of `python -m lab matrix`, "
                   "e.g. \"--jobs 3 --resume\"")
    p.add_argument("--speedup", type=float, help="crosscheck simulator speedup (default: the demo's)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS and n != "report"]
    if unknown:
        p.error(f"unknown benchmark {' '.join(unknown)}; known: {' '.join(BENCHMARKS)} report")
    names = args.names or list(BENCHMARKS)
    failed = []
    for name in names:
        if name == "report":
            continue
        started = time.monotonic()
        print(f"== bench {name}", flush=True)
        try:
            BENCHMARKS[name](args)
        except Exception as e:  # one broken benchmark must not lose the others' results
            failed.append(name)
            traceback.print_exc()
            print(f"bench {name} FAILED: {e}", file=sys.stderr, flush=True)
        print(f"== bench {name}: {time.monotonic() - started:.0f} s", flush=True)
    report.write()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
