"""Plots of lab results: TTFT CDF per policy, per-endpoint KV usage over virtual time.

    python -m lab plot results/lab-article     # writes ttft_cdf.png and kv_<policy>_seed<S>.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lab.policies import file_name  # noqa: E402


def _runs(folder: Path) -> list[tuple[Path, dict]]:
    """The folder's result files; when summary.json is there, only the runs it summarises (an
    earlier run into the same folder may have left files of other policies or seeds)."""
    wanted = None
    summary = folder / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        wanted = {f"{s['workload']}-{file_name(policy)}-seed{seed}.json"
                  for policy in s.get("policies", {}) for seed in s.get("seeds", [])}
    out = []
    for path in sorted(folder.glob("*-seed*.json")):
        if path.name.endswith(".series.json") or (wanted is not None and path.name not in wanted):
            continue
        out.append((path, json.loads(path.read_text())))
    if not out:
        raise ValueError(f"{folder}: no lab result files (*-seed*.json)")
    return out


def plot_ttft_cdf(folder: Path) -> Path:
    by_policy: dict[str, list[float]] = {}
    for _, run in _runs(folder):
        by_policy.setdefault(run["policy"], []).extend(run.get("ttfts", []))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, ttfts in sorted(by_policy.items()):
        if not ttfts:
            continue
        x = np.sort(np.asarray(ttfts))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{policy} (n={len(x)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, all seeds ({folder.name})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = folder / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_kv_series(folder: Path, seed: int = 0) -> list[Path]:
    outputs = []
    for path, run in _runs(folder):
        if run.get("seed") != seed:
            continue
        series = json.loads(path.with_name(path.stem + ".series.json").read_text())
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for address, s in series.items():
            ax.plot(s["t"], s["kv"], label=address, linewidth=0.8)
        ax.set_xlabel("virtual time (s)")
        ax.set_ylabel("KV cache usage")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"KV usage per group: {run['policy']}, seed {seed}")
        ax.legend(fontsize=8)
        out = folder / f"kv_{file_name(run['policy'])}_seed{seed}.png"
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)
        outputs.append(out)
    return outputs


def plot_folder(folder: Path, seed: int = 0) -> list[Path]:
    return [plot_ttft_cdf(folder), *plot_kv_series(folder, seed)]
