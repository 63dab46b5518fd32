"""Bring your own workload: a JSONL trace, one request per line, replayed by loadtest and the lab.

    {"prompt_tokens": 3000, "output_tokens": 1500, "prefix_group": "tenant-1", "prefix_tokens": 1000, "arrival_time": 0.0}
    {"prompt": "Summarise the following report ...", "output_tokens": 200, "arrival_time": 0.8}

Fields of a line (a JSON object):

- `prompt` (string) or `prompt_tokens` (integer >= 1): the prompt's text, or its length; a length
  becomes synthetic words (1 word = 1 token, as everywhere in loadtest);
- `output_tokens` (integer >= 1, required): max_tokens, sent with ignore_eos so the output has
  exactly this length;
- `prefix_group` (string, optional): requests of a group share a prefix (a tenant's system
  prompt, a chat session's history). With `prompt_tokens` give `prefix_tokens` too (the shared
  part's length, <= prompt_tokens): every request of the group starts with the same synthetic
  prefix of that length (the longest `prefix_tokens` seen for the group, cut to each request's
  own). With `prompt` the text itself carries the prefix and the group is only a label;
- `arrival_time` (seconds from the start, >= 0, optional): give it on every line or on none.
  With arrival times the request is sent at that time (and when a concurrency slot is free, if
  the run also limits concurrency); without, the run's own arrival process applies.

Lines are replayed in file order (the seed only changes the synthetic words); blank lines and
lines starting with `#` are skipped. See loadtest/examples/trace.jsonl.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from loadtest.prompts import PromptSpec, random_words

FIELDS = {"prompt", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens",
          "arrival_time"}


def _int_field(rec: dict, key: str, where: str, minimum: int) -> int:
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def read_trace(path: str | Path) -> list[dict]:
    """The trace's records, validated; errors name the file, the line and the field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read trace {path}: {err}") from err
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        unknown = set(rec) - FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(FIELDS))}")
        if ("prompt" in rec) == ("prompt_tokens" in rec):
            raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_tokens'")
        if "prompt" in rec and (not isinstance(rec["prompt"], str) or not rec["prompt"].split()):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if "prompt_tokens" in rec:
            _int_field(rec, "prompt_tokens", where, 1)
        if "output_tokens" not in rec:
            raise ValueError(f"{where}: 'output_tokens' is required")
        _int_field(rec, "output_tokens", where, 1)
        group = rec.get("prefix_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise ValueError(f"{where}: 'prefix_group' must be a non-empty string")
        if "prefix_tokens" in rec:
            if group is None or "prompt_tokens" not in rec:
                raise ValueError(f"{where}: 'prefix_tokens' needs 'prefix_group' and 'prompt_tokens'")
            if _int_field(rec, "prefix_tokens", where, 0) > rec["prompt_tokens"]:
                raise ValueError(f"{where}: 'prefix_tokens' is larger than 'prompt_tokens'")
        elif group is not None and "prompt_tokens" in rec:
            raise ValueError(f"{where}: 'prefix_group' with 'prompt_tokens' needs 'prefix_tokens'")
        if "arrival_time" in rec:
            t = rec["arrival_time"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
                raise ValueError(f"{where}: 'arrival_time' must be a number >= 0, got {t!r}")
        rec["_where"] = where
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: the trace has no requests")
    timed = sum("arrival_time" in r for r in records)
    if 0 < timed < len(records):
        raise ValueError(f"{path}: 'arrival_time' is on {timed} of {len(records)} lines; "
                         "give it on every line or on none")
    return records


def trace_workload(seed: int, path: str | None, num_prompts: int | None = None) -> list:
    """PromptSpecs of a trace file, in file order (the first num_prompts lines if given)."""

    if not path:
        raise ValueError("the trace workload needs path=<JSONL trace file>")
    records = read_trace(path)
    if num_prompts:
        records = records[:num_prompts]
    prefix_len: dict[str, int] = {}
    for r in records:
        if "prefix_tokens" in r:
            prefix_len[r["prefix_group"]] = max(prefix_len.get(r["prefix_group"], 0),
                                                r["prefix_tokens"])
    prefixes = {g: random_words(np.random.default_rng([seed, zlib.crc32(g.encode())]), n)
                for g, n in prefix_len.items()}
    rng = np.random.default_rng(seed)
    specs = []
    for r in records:
        if "prompt" in r:
            prompt = " ".join(r["prompt"].split())
        else:
            shared = r.get("prefix_tokens", 0)
            head = " ".join(prefixes[r["prefix_group"]].split(" ")[:shared]) if shared else ""
            prompt = " ".join(p for p in (head, random_words(rng, r["prompt_tokens"] - shared)) if p)
        specs.append(PromptSpec(prompt=prompt, prompt_tokens=len(prompt.split(" ")),
                                output_tokens=r["output_tokens"], group=r.get("prefix_group", ""),
                                arrival=float(r["arrival_time"]) if "arrival_time" in r else None))
    return specs

