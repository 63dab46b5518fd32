"""The one error type the request path raises; the protocol layer turns it into an HTTP reply."""
from __future__ import annotations

import json

CLIP_CHARS = 128


def clip(value: str, limit: int = CLIP_CHARS) -> str:
    """A client-supplied string cut to a size fit for a message or a log line."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}...({len(value)} chars)"


_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class PickerError(Exception):
    def __init__(self, status: int, message: str, code: str, model: str = "",
                 target_model: str = ""):
        super().__init__(message)
        self.model = model
        self.target_model = target_model
        self.status = status
        self.message = message
        self.code = code

    def openai_body(self) -> bytes:
        """OpenAI-style error JSON, like vLLM and the OpenAI API return."""
        err = {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
               "param": None, "code": self.code}
        return json.dumps({"error": err}).encode()

    def __repr__(self) -> str:
        return f"PickerError({self.status}, {self.message!r}, {self.code!r})"
