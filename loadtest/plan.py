"""Run options and the prompt schedule shared by the users of one locust process.

No locust/gevent imports: users run as greenlets, which only switch at I/O, so plain counters
are safe here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from loadtest.metrics import RequestSample
from loadtest.openai_api import ENDPOINTS
from loadtest.workloads import PromptSpec, build_workload, profile_settings


def parse_ports(text: str | list | None) -> list[int]:
    """'8080 8081' or '8080,8081' or [8080, 8081] -> [8080, 8081]; '' -> []."""
    if not text:
        return []
    items = text if isinstance(text, list) else str(text).replace(",", " ").split()
    try:
        ports = [int(p) for p in items]
    except ValueError:
        raise ValueError(f"ports must be integers, got {text!r}") from None
    if any(not 0 < p < 65536 for p in ports):
        raise ValueError(f"ports must be in 1..65535, got {text!r}")
    return ports


def parse_workload_args(text: str) -> dict:
    """'path=/data/sg.json,input_len=2000' -> {'path': '/data/sg.json', 'input_len': 2000}."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"workload argument {item!r} is not key=value")
        for cast in (int, float):
            try:
                out[key.strip()] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = value.strip()
    return out


@dataclass
class RunOptions:
    workload: str = "demo"
    seed: int = 0
    ports: list[int] = field(default_factory=list)  # [] -> the host's own port
    model: str = "qwq"
    endpoint: str = "completions"                   # or "chat"
    objective: str = ""                             # x-gateway-inference-objective header
    num_prompts: int | None = None                  # None -> the profile's
    request_rate: float = 0.0                       # req/s; 0 -> closed loop, as fast as users go
    burstiness: float = 1.0                         # gamma shape of the gaps (1 = Poisson)
    cycle: bool = False                             # start over when the prompts are used up
    request_timeout: float = 900.0                  # s, whole request including the stream
    workload_args: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.request_rate < 0 or self.burstiness <= 0:
            raise ValueError("request_rate must be >= 0 and burstiness > 0")

    def settings(self) -> dict:
        return profile_settings(self.workload, num_prompts=self.num_prompts, **self.workload_args)

    def build(self) -> list[PromptSpec]:
        return build_workload(self.workload, seed=self.seed, num_prompts=self.num_prompts,
                              **self.workload_args)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from start) like vLLM: gamma gaps with mean 1/rate; rate 0 -> all at 0."""
    if rate <= 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out immediately
    return np.cumsum(gaps)


class RunPlan:
    """Hands out this process's share of the prompts and collects finished samples.

    worker_index/worker_count split the prompts between distributed workers (prompt i goes to
    worker i % worker_count); each prompt is sent once unless `cycle` is set.
    """

    def __init__(self, specs: list[PromptSpec], options: RunOptions, *, worker_index: int = 0,
                 worker_count: int = 1, on_sample: Callable[[RequestSample], None] | None = None,
                 on_done: Callable[[], None] | None = None, clock=time.monotonic):
        offsets = arrival_offsets(len(specs), options.request_rate, options.burstiness,
                                  options.seed)
        if options.request_rate == 0 and specs and all(s.arrival is not None for s in specs):
            offsets = [s.arrival for s in specs]     # a trace's own arrival times
        self.items = sorted(((i, specs[i], float(offsets[i]))
                             for i in range(len(specs)) if i % worker_count == worker_index),
                            key=lambda item: item[2])
        self.options = options
        self.samples: list[RequestSample] = []
        self.issued = 0
        self.on_sample = on_sample
        self.on_done = on_done
        self.clock = clock
        self.started = clock()
        self.finished = False
        self._user_count = 0
        self._cycle_base = 0.0

    @property
    def total(self) -> int:
        return len(self.items)

    def next_port(self) -> int | None:
        """Round-robin port per user (None: use the host's port)."""
        ports = self.options.ports
        self._user_count += 1
        return ports[(self._user_count - 1) % len(ports)] if ports else None

    def next_request(self) -> tuple[PromptSpec, float] | None:
        """The next prompt and its send time (clock value), or None when all are handed out."""
        if self.issued >= self.total:
            if not self.options.cycle or not self.items:
                return None
        index = self.issued % self.total if self.total else 0
        if self.options.cycle and index == 0 and self.issued:
            self._cycle_base = max(self.clock() - self.started, self._cycle_base)
        _, spec, offset = self.items[index]
        self.issued += 1
        return spec, self.started + self._cycle_base + offset

    def record(self, sample: RequestSample) -> None:
        self.samples.append(sample)
        if self.on_sample:
            self.on_sample(sample)
        if not self.options.cycle and len(self.samples) >= self.total and not self.finished:
            self.finished = True
            if self.on_done:
                self.on_done()

    def progress(self) -> str:
        done = len(self.samples)
        failed = sum(1 for s in self.samples if not s.success)
        elapsed = self.clock() - self.started
        line = f"{done}/{self.total} done, {failed} failed, {elapsed:.0f}s elapsed"
        if 0 < done < self.total and not self.options.cycle:
            line += f", ETA {elapsed / done * (self.total - done):.0f}s"
        return line
