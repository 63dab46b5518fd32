"""What a scheduling step sees about one request."""
from __future__ import annotations

from dataclasses import dataclass, field

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

    def cached_tokens(self, address: str) -> int:
        return min(self.prompt_tokens, self.prefix_match.get(address, 0) * self.block_size_tokens)
