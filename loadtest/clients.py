"""Several clients in one run: each its own API key, objective, open-loop rate and prompts.

    python -m loadtest compare --ports 18081 --repetitions 1 --concurrency 1000 \
        --client name=heavy,rate=5,prompts=150,key_env=HEAVY_KEY \
        --client name=light,rate=0.5,prompts=15,key_env=LIGHT_KEY,objective=interactive \
        --client name=reasoning,rate=0.5,prompts=15,output_len=300-600

A client's prompts and send times depend only on the run's workload and seed and on its own
name, rate and count, never on the other clients: a client run alone gets the same requests at
the same times as next to the others. With `output_len=LOW-HIGH` its answers' lengths
(max_tokens, sent with ignore_eos) are drawn uniformly from that range instead of the
workload's: clients that send alike prompts but get answers of different lengths (a chat app and
a reasoning app). Its key is read from the environment variable `key_env`
(keys stay off the command line); without one it sends the run's key. Every sample carries its
client's name, and result files then hold each client's own statistics (`by_client`).

No locust imports.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace

import numpy as np

from loadtest.prompts import PromptSpec

FIELDS = ("name", "rate", "prompts", "key_env", "objective", "burstiness", "output_len")


@dataclass(frozen=True)
class ClientStream:
    name: str
    rate: float                 # req/s, open loop
    prompts: int                # requests it sends
    key_env: str = ""           # environment variable with its API key ("" = the run's key)
    objective: str | None = None  # x-gateway-inference-objective (None = the run's --objective)
    burstiness: float = 1.0     # gamma shape of its gaps (1 = Poisson)
    output_len: tuple[int, int] | None = None   # its answers' lengths, uniform (None: the workload's)

    def __post_init__(self):
        if not self.name or "," in self.name or "=" in self.name:
            raise ValueError(f"client name {self.name!r}: a non-empty word without ',' or '='")
        if self.rate <= 0 or self.prompts < 1 or self.burstiness <= 0:
            raise ValueError(f"client {self.name}: rate and burstiness must be > 0 and prompts >= 1")
        if self.output_len is not None and not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"client {self.name}: output_len must be LOW-HIGH with 1 <= LOW <= HIGH")

    def seed(self, run_seed: int) -> int:
        """Its own seed: the run's plus a stable hash of its name."""
        return run_seed + zlib.crc32(self.name.encode()) % 100_003

    def api_key(self, default: str | None) -> str | None:
        if not self.key_env:
            return default
        key = os.environ.get(self.key_env)
        if not key:
            raise ValueError(f"client {self.name}: ${self.key_env} (its API key) is not set")
        return key


def parse_client(text: str) -> ClientStream:
    """'name=heavy,rate=5,prompts=150,key_env=K,objective=interactive' -> ClientStream."""
    fields: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in FIELDS:
            raise ValueError(f"--client {text!r}: {item!r} is not one of {', '.join(f + '=' for f in FIELDS)}")
        fields[key] = value.strip()
    missing = [k for k in ("name", "rate", "prompts") if k not in fields]
    if missing:
        raise ValueError(f"--client {text!r}: missing {', '.join(missing)}")
    try:
        return ClientStream(name=fields["name"], rate=float(fields["rate"]), prompts=int(fields["prompts"]),
                            key_env=fields.get("key_env", ""), objective=fields.get("objective"),
                            burstiness=float(fields.get("burstiness", 1.0)),
                            output_len=_length_range(fields["output_len"]) if "output_len" in fields else None)
    except ValueError as err:
        raise ValueError(f"--client {text!r}: {err}") from None


def _length_range(text: str) -> tuple[int, int]:
    """'300-600' -> (300, 600); '300' -> (300, 300)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def client_specs(clients, build, arrivals, seed: int) -> list[PromptSpec]:
    """Every client's prompts, named after it and timed by its own arrivals, merged by send time.

    build(seed, n) -> n PromptSpecs; arrivals(n, rate, burstiness, seed) -> n send offsets (s)."""
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise ValueError(f"client names must differ: {names}")
    out = []
    for c in clients:
        own = c.seed(seed)
        specs = build(own, c.prompts)
        if c.output_len is not None:
            lengths = np.random.default_rng(own).integers(c.output_len[0], c.output_len[1] + 1, size=len(specs))
            specs = [replace(s, output_tokens=int(n)) for s, n in zip(specs, lengths)]
        for spec, at in zip(specs, arrivals(c.prompts, c.rate, c.burstiness, own)):
            out.append(replace(spec, client=c.name, arrival=float(at)))
    return sorted(out, key=lambda s: s.arrival)


def client_headers(clients, base: dict[str, str], key: str | None, objective: str,
                   objective_header: str) -> dict[str, dict[str, str]]:
    """The headers of each client's requests: `base`, its key as a bearer token, its objective."""
    out = {}
    for c in clients:
        headers = dict(base)
        own_key, own_objective = c.api_key(key), objective if c.objective is None else c.objective
        if own_key:
            headers["Authorization"] = f"Bearer {own_key}"
        if own_objective:
            headers[objective_header] = own_objective
        out[c.name] = headers
    return out
