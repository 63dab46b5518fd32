"""What the deployment answered: one finished request as Envoy's access log reports it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Outcome:
    request_id: str                  # the picker's id of the decision ("" if the entry has none)
    endpoint: str                    # "ip:port" of the upstream host that served it
    status: int                      # HTTP status
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft: float | None               # seconds from the request's start at the gateway to its first token
    duration: float                  # seconds from the request's start to its last byte
    client: str                      # x-client-id ("" if none)
    model: str                       # the model the request was routed for ("" if unknown)
    features: str                    # what the decision recorded for the predictor ("" if none)
    finished_at: float               # time.monotonic() of the picker when received
