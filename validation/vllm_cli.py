"""vLLM's command line: every flag that a `vllm serve` container passes is a flag of the vLLM its
image pins. vLLM renames and removes flags between versions, and a server given an unknown flag
exits at start, in a crash loop no render or schema shows.

The flag lists come from vLLM's own argument parser (local/vllm_server/cli_flags.py, run in the
virtualenv of `make vllm`), one file per image tag in validation/vllm-cli/<tag>.txt. A pinned tag
without a list is a problem too: the list is what lets a pin move safely.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

from validation.manifests import argv, pod_templates, vllm_container

IMAGE = "vllm/vllm-openai"
FLAGS_DIR = Path(__file__).resolve().parent / "vllm-cli"


@cache
def known_flags(tag: str) -> frozenset[str] | None:
    path = FLAGS_DIR / f"{tag}.txt"
    if not path.is_file():
        return None
    return frozenset(line.strip() for line in path.read_text().splitlines() if line.strip())


def _serve_flags(args: list[str]) -> list[str]:
    """The long flags after `serve` (values that look like flags do not occur in these args)."""
    after = args[args.index("serve") + 1:] if "serve" in args else args
    return [a.split("=", 1)[0] for a in after if a.startswith("--") and len(a) > 2]


def vllm_flags_exist(objs) -> list[str]:
    problems = []
    for t in pod_templates(objs):
        path, container = vllm_container(t)
        if container is None:
            continue
        image = str(container.get("image") or "")
        repo, _, tag = image.rpartition(":")
        where = f"{t.where}: {path}"
        if repo != IMAGE or not tag:
            problems.append(f"{where}: image {image!r} is not a tagged {IMAGE} image, so its "
                            f"flags cannot be checked")
            continue
        flags = known_flags(tag)
        if flags is None:
            problems.append(f"{where}: no flag list for {image} (validation/vllm-cli/{tag}.txt); "
                            f"generate it from that version's CLI with local/vllm_server/cli_flags.py")
            continue
        for flag in _serve_flags(argv(container)):
            if flag not in flags:
                problems.append(f"{where}: {flag} is not a flag of `vllm serve` in {image}")
    return problems


VLLM_CLI_CHECKS = [vllm_flags_exist]
