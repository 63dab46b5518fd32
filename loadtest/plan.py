"""Run options and the prompt schedule shared by the users of one locust process.

No locust/gevent imports: users run as greenlets, which only switch at I/O, so plain counters
are safe here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from loadtest.clients import client_specs
from loadtest.metrics import RequestSample
from loadtest.openai_api import ENDPOINTS
from loadtest.prompts import PromptSpec
from loadtest.workloads import build_workload, workload_settings


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


MODES = ("ab", "parallel")


@dataclass
class RunOptions:
    workload: str = "demo"
    seed: int = 0
    ports: list[int] = field(default_factory=list)  # [] -> the host's own port
    model: str = "qwq"
    endpoint: str = "completions"                   # or "chat"
    objective: str = ""                             # x-gateway-inference-objective header
    num_prompts: int | None = None                  # None -> the workload's
    request_rate: float = 0.0                       # req/s; 0 -> closed loop, as fast as users go
    burstiness: float = 1.0                         # gamma shape of the gaps (1 = Poisson)
    cycle: bool = False                             # start over when the prompts are used up
    request_timeout: float = 900.0                  # s, whole request including the stream
    workload_args: dict = field(default_factory=dict)
    mode: str = "parallel"                          # "ab": one port after the other, same prompts
    clients: tuple = ()                             # ClientStreams (loadtest/clients.py): their own rates

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.request_rate < 0 or self.burstiness <= 0:
            raise ValueError("request_rate must be >= 0 and burstiness > 0")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.mode == "ab" and self.cycle:
            raise ValueError("--cycle-prompts never ends a phase: use it with --mode parallel")
        if self.clients and (self.request_rate or self.num_prompts or self.cycle):
            raise ValueError("clients bring their own rates and prompt counts: no --request-rate, "
                             "--num-prompts or --cycle-prompts with --client")

    @property
    def total_prompts(self) -> int | None:
        """The clients' prompts in all (None without clients: the workload's or num_prompts)."""
        return sum(c.prompts for c in self.clients) if self.clients else None

    def settings(self) -> dict:
        return workload_settings(self.workload, num_prompts=self.num_prompts or self.total_prompts,
                                 **self.workload_args)

    def build(self) -> list[PromptSpec]:
        if self.clients:
            return client_specs(self.clients, self._build, arrival_offsets, self.seed)
        return self._build(self.seed, self.num_prompts)

    def _build(self, seed: int, num_prompts: int | None) -> list[PromptSpec]:
        return build_workload(self.workload, seed=seed, num_prompts=num_prompts, **self.workload_args)

    def phases(self) -> list[list[int]]:
        """Ports of each phase: A/B runs one port per phase, parallel all at once."""
        if self.mode == "ab" and len(self.ports) > 1:
            return [[p] for p in self.ports]
        return [list(self.ports)]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from start) like vLLM: gamma gaps with mean 1/rate; rate 0 -> all at 0."""
    if rate <= 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out immediately
    return np.cumsum(gaps)


WAIT = "wait"   # next_request(): the current phase is draining or waits for the next to start


class RunPlan:
    """Hands out this process's share of the prompts and collects finished samples.

    worker_index/worker_count split the prompts between distributed workers (prompt i goes to
    worker i % worker_count); each prompt is sent once per phase unless `cycle` is set. Phases
    (options.phases()): in A/B mode every port gets all the prompts, one port after the other;
    a phase starts when the previous one has answered every request (on_phase_done decides
    when: by default at once; distributed workers wait for the master).
    """

    def __init__(self, specs: list[PromptSpec], options: RunOptions, *, worker_index: int = 0,
                 worker_count: int = 1, on_sample: Callable[[RequestSample], None] | None = None,
                 on_done: Callable[[], None] | None = None,
                 on_phase_done: Callable[[int], None] | None = None, clock=time.monotonic):
        offsets = arrival_offsets(len(specs), options.request_rate, options.burstiness,
                                  options.seed)
        if options.request_rate == 0 and specs and all(s.arrival is not None for s in specs):
            offsets = [s.arrival for s in specs]     # a trace's own arrival times
        self.items = sorted(((i, specs[i], float(offsets[i]))
                             for i in range(len(specs)) if i % worker_count == worker_index),
                            key=lambda item: item[2])
        self.options = options
        self.phase_ports = options.phases()
        self.samples: list[RequestSample] = []
        self.on_sample = on_sample
        self.on_done = on_done
        self.on_phase_done = on_phase_done or self.start_phase
        self.clock = clock
        self.started = clock()
        self.finished = False
        self.phase = 0
        self.phase_started = self.started
        self.phase_starts: list[float] = [self.started]   # clock value when each phase began
        self.phase_open = True
        self.issued = 0              # handed out in this phase
        self.recorded = 0            # answered in this phase
        self._user_count = 0
        self._cycle_base = 0.0

    @property
    def total(self) -> int:
        """Prompts of this process per phase."""
        return len(self.items)

    @property
    def phase_count(self) -> int:
        return len(self.phase_ports)

    @property
    def total_requests(self) -> int:
        return self.total * self.phase_count

    def next_port(self) -> int | None:
        """Round-robin port per user in parallel mode (None: use the host's port)."""
        ports = self.options.ports
        self._user_count += 1
        return ports[(self._user_count - 1) % len(ports)] if ports else None

    def current_port(self) -> int | None:
        """The port of an A/B phase; None in parallel mode (each user keeps its own)."""
        ports = self.phase_ports[self.phase]
        return ports[0] if self.phase_count > 1 else None

    def next_request(self):
        """(prompt, send time as a clock value, port or None), WAIT, or None when all is sent."""
        if self.finished:
            return None
        if not self.phase_open:
            return WAIT
        if self.issued >= self.total:
            if not self.options.cycle or not self.items:
                return WAIT if self.phase + 1 < self.phase_count else None
        index = self.issued % self.total if self.total else 0
        if self.options.cycle and index == 0 and self.issued:
            self._cycle_base = max(self.clock() - self.phase_started, self._cycle_base)
        _, spec, offset = self.items[index]
        self.issued += 1
        return spec, self.phase_started + self._cycle_base + offset, self.current_port()

    def start_phase(self, index: int | None = None) -> None:
        """Open the next phase (or phase `index`): its prompts are handed out from now on."""
        nxt = self.phase + 1 if index is None else index
        if nxt >= self.phase_count or (nxt == self.phase and self.phase_open):
            return
        self.phase, self.issued, self.recorded = nxt, 0, 0
        self.phase_started = self.clock()
        self.phase_starts.append(self.phase_started)
        self.phase_open = True

    def record(self, sample: RequestSample) -> None:
        self.samples.append(sample)
        self.recorded += 1
        if self.on_sample:
            self.on_sample(sample)
        if self.options.cycle or self.recorded < self.total or not self.phase_open:
            return
        if self.phase + 1 < self.phase_count:
            self.phase_open = False
            self.on_phase_done(self.phase + 1)
        elif not self.finished:
            self.finished = True
            if self.on_done:
                self.on_done()

    def phase_label(self) -> str:
        if self.phase_count == 1:
            return ""
        return f"phase {self.phase + 1}/{self.phase_count}: port {self.current_port()}"

    def progress(self) -> str:
        done = len(self.samples)
        failed = sum(1 for s in self.samples if not s.success)
        elapsed = self.clock() - self.started
        total = self.total_requests
        line = f"{done}/{total} done, {failed} failed, {elapsed:.0f}s elapsed"
        if self.phase_count > 1:
            line = f"{self.phase_label()}, " + line
        if 0 < done < total and not self.options.cycle:
            line += f", ETA {elapsed / done * (total - done):.0f}s"
        return line
