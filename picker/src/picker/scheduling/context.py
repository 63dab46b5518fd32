"""What a scheduling step sees about one request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from picker import defaults


@dataclass(slots=True)
class SchedulingContext:
    target_model: str
    prompt_tokens: int
    max_tokens: int | None
    priority: int
    now: float
    block_size_tokens: int = defaults.PREFIX_BLOCK_SIZE_TOKENS
    hashes: list[int] = field(default_factory=list)
    prefix_match: dict[str, int] = field(default_factory=dict)  # address -> leading blocks held
    avg_prompt_tokens: float = 0.0   # running mean over recent requests, sizes unknown work
    # Precise prefix routing (scheduling/precise.py): cached tokens per endpoint from the
    # engines' KV events, used for the endpoints whose events are in sync (sync[a] == "");
    # the others fall back to the approximate prefix_match.
    precise: dict[str, int] | None = None
    sync: dict[str, str] | None = None
    # Output lengths (picker.lengths), when the predictor is on: the request's forecast answer
    # length, and per endpoint the projection of its KV over its running requests' ends.
    forecast: Any = None                                   # lengths.predictor.Forecast
    projection: Callable[[Any], Any] | None = None         # EndpointState -> lengths.work.Projection

    def cached_tokens(self, address: str) -> int:
        if self.precise is not None and self.sync.get(address) == "":
            return min(self.prompt_tokens, self.precise.get(address, 0))
        return min(self.prompt_tokens, self.prefix_match.get(address, 0) * self.block_size_tokens)

    def owner_tokens(self) -> dict[str, int]:
        """Cached tokens of the endpoints believed to hold some of the prompt (prefilter)."""
        if self.precise is None:
            return self.prefix_match
        sync, bs = self.sync, self.block_size_tokens
        out = {a: n * bs for a, n in self.prefix_match.items() if sync.get(a) != ""}
        out.update((a, n) for a, n in self.precise.items() if n)
        return out
