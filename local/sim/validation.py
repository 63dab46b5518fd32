"""Request checks with vLLM 0.32's statuses and error bodies (held to the real server by
tests/conformance).

vLLM validates a body in two layers, and its errors read differently for each:
- FastAPI + pydantic (content type, JSON syntax, field types): 400 with type "Bad Request", the
  pydantic error dict as the message (`1 validation error:\\n  {...}`, the dict's Python repr),
  and its location (`body.<field>`, or `body.<char offset>` for bad JSON) as the param;
- the OpenAI layer (model, prompt, token limits): 400 "BadRequestError" or 404 "NotFoundError"
  with a sentence and a `(parameter=..., value=...)` suffix.
Only the fields the simulator reads are checked; like vLLM's pydantic models in lax mode, numeric
strings ("0.5", "4") pass as numbers.
"""

from __future__ import annotations

import json
from typing import Any, Optional


class RequestError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict:
        """vLLM's ErrorResponse: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


def _pydantic(error: dict) -> RequestError:
    return RequestError(400, f"1 validation error:\n  {error!r}", "Bad Request", error.get("loc"))


def _input_repr(value: Any) -> Any:
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    return value


def parse_body(raw: bytes, content_type: str) -> dict:
    """The JSON object of a POST body, or the RequestError vLLM answers."""
    if content_type != "application/json":
        raise RequestError(400, "1 validation error:\n  Unsupported Media Type: Only "
                                "'application/json' is allowed", "Bad Request")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _pydantic({"type": "json_invalid", "loc": f"body.{err.pos}", "msg": "JSON decode error",
                         "input": "<dict of 0 items>", "ctx": {"error": err.msg}}) from None
    except UnicodeDecodeError:
        raise _pydantic({"type": "json_invalid", "loc": "body", "msg": "JSON decode error",
                         "input": "<dict of 0 items>", "ctx": {"error": "invalid UTF-8"}}) from None
    if not isinstance(body, dict):
        raise _pydantic({"type": "model_attributes_type", "loc": "body",
                         "msg": "Input should be a valid dictionary or object to extract fields from",
                         "input": _input_repr(body)})
    return body


def _lax_int(body: dict, field: str) -> Optional[int]:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or isinstance(value, int):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _pydantic({"type": "int_parsing", "loc": f"body.{field}",
                     "msg": "Input should be a valid integer, unable to parse string as an integer",
                     "input": _input_repr(value)})


def _lax_float(body: dict, field: str) -> Optional[float]:
    value = body.get(field)
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _pydantic({"type": "float_parsing", "loc": f"body.{field}",
                     "msg": "Input should be a valid number, unable to parse string as a number",
                     "input": _input_repr(value)})


def check_model(body: dict, names: list[str]) -> str:
    """The served name the request asks for; a missing model means the first one (as in vLLM)."""
    model = body.get("model")
    if model is None:
        return names[0]
    if model not in names:
        raise RequestError(404, f"The model `{model}` does not exist. Valid aliases: "
                                f"{', '.join(names)}.", "NotFoundError", "model")
    return model


def check_max_tokens(body: dict, chat: bool, max_model_len: int) -> Optional[int]:
    """The output limit the request sets (None: up to the context), checked like vLLM."""
    _lax_float(body, "temperature")
    max_tokens = _lax_int(body, "max_tokens")
    if chat:
        completion = _lax_int(body, "max_completion_tokens")
        max_tokens = completion if completion is not None else max_tokens
    elif max_tokens is None:
        max_tokens = 16                                   # vLLM's completions default
    _check_min_tokens(_lax_int(body, "min_tokens"), max_tokens)
    if max_tokens is None:
        return None
    if max_tokens < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {max_tokens}. "
                                f"(parameter=max_tokens, value={max_tokens})",
                           "BadRequestError", "max_tokens")
    if max_tokens > max_model_len:
        raise RequestError(400, f"max_tokens={max_tokens} cannot be greater than "
                                f"max_model_len={max_model_len}. Please request fewer output "
                                f"tokens. (parameter=max_tokens, value={max_tokens})",
                           "BadRequestError", "max_tokens")
    return max_tokens


def _check_min_tokens(minimum: Optional[int], max_tokens: Optional[int]) -> None:
    """vLLM's SamplingParams checks of min_tokens (its messages)."""
    if minimum is None:
        return
    if minimum < 0:
        raise RequestError(400, f"min_tokens must be greater than or equal to 0, got {minimum}.",
                           "BadRequestError", "min_tokens")
    if max_tokens is not None and minimum > max_tokens:
        raise RequestError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                f"got {minimum}.", "BadRequestError", "min_tokens")


def empty_prompt() -> RequestError:
    return RequestError(400, "Either prompt or prompt_embeds must be provided and non-empty. "
                             "(parameter=prompt)", "BadRequestError", "prompt")


def empty_conversation() -> RequestError:
    return RequestError(400, "Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.", "BadRequestError")


def check_prompt_length(prompt_tokens: int, max_model_len: int) -> None:
    """A prompt that leaves no room for one output token is refused (vLLM tokenizes at most
    max_model_len + 1 tokens, so its message says 'at least' that many)."""
    if prompt_tokens >= max_model_len:
        n = min(prompt_tokens, max_model_len + 1)
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens. "
                                f"However, your prompt contains at least {n} input tokens, which "
                                f"exceeds this limit even without any output tokens. Please "
                                f"reduce the length of the input prompt. "
                                f"(parameter=input_tokens, value={n})",
                           "BadRequestError", "input_tokens")
