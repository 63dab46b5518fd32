"""The request set the conformance suite sends to the simulator and to real vLLM, and the parts
of each answer that matter to this project's clients (the picker, the load tests, the OpenAI
client): status, error type/param/code/message, SSE framing and usage chunks, response objects,
/tokenize, /v1/models.

The names are those of the reference captures of vLLM 0.32 (capture_http.py in the shared
samples), so an answer from the simulator can be compared with a live server or a recording.
Prompts are built from the load tests' words, which are one token each in the simulator and in
the tiny model's tokenizer, so token counts compare exactly against a live server.
"""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from loadtest.prompts import VOCABULARY


@dataclass(frozen=True)
class Exchange:
    name: str
    method: str
    path: str
    body: Any = None                 # JSON-encoded when not None
    raw: Optional[bytes] = None      # sent as is
    content_type: Optional[str] = "application/json"
    counts: bool = False             # token counts comparable (prompt made of workload words)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)
    # False for a recorded answer to a request without ignore_eos: where the random-weight
    # model put its EOS decides the finish reason, so that is not compared
    eos_comparable: bool = True


def words(n: int, offset: int = 0) -> str:
    return " ".join(str(VOCABULARY[(offset + i) % len(VOCABULARY)]) for i in range(n))


def exchanges(model: str, max_len: int) -> list[Exchange]:
    prompt = words(40)
    chat = [{"role": "system", "content": words(3, 100)}, {"role": "user", "content": words(20, 200)}]
    def post(name, path, body, counts=False):
        return Exchange(name, "POST", path, body, counts=counts)

    return [
        Exchange("models", "GET", "/v1/models"),
        Exchange("health", "GET", "/health"),
        post("completion", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True}, True),
        post("completion_stream_usage", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}, True),
        post("completion_stream_no_usage", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0,
              "ignore_eos": True, "stream": True}, True),
        post("completion_token_ids_prompt", "/v1/completions",
             {"model": model, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "ignore_eos": True}, True),
        post("completion_default_max_tokens", "/v1/completions",
             {"model": model, "prompt": prompt, "ignore_eos": True}, True),
        post("chat", "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 8,
                                              "temperature": 0, "ignore_eos": True}, True),
        post("chat_stream_usage", "/v1/chat/completions",
             {"model": model, "messages": chat, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
              "stream": True, "stream_options": {"include_usage": True}}, True),
        post("chat_max_completion_tokens", "/v1/chat/completions",
             {"model": model, "messages": chat, "max_completion_tokens": 3, "ignore_eos": True}, True),
        post("tokenize_prompt", "/tokenize", {"model": model, "prompt": words(7, 300)}, True),
        post("tokenize_messages", "/tokenize", {"model": model, "messages": chat[:1]}, True),
        Exchange("version", "GET", "/version"),
        Exchange("unknown_path", "GET", "/v1/nope"),
        post("bad_unknown_model", "/v1/completions",
             {"model": "no-such-model", "prompt": prompt, "max_tokens": 4}),
        post("bad_unknown_model_chat", "/v1/chat/completions",
             {"model": "no-such-model", "messages": chat, "max_tokens": 4}),
        post("bad_missing_model", "/v1/completions", {"prompt": prompt, "max_tokens": 4}, True),
        post("bad_missing_model_chat", "/v1/chat/completions", {"messages": chat, "max_tokens": 4}, True),
        post("bad_empty_prompt", "/v1/completions", {"model": model, "prompt": "", "max_tokens": 4}),
        post("bad_missing_prompt", "/v1/completions", {"model": model, "max_tokens": 4}),
        post("bad_empty_messages", "/v1/chat/completions", {"model": model, "messages": [], "max_tokens": 4}),
        post("bad_max_tokens_over_context", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": max_len + 10}),
        post("bad_chat_max_tokens_over_context", "/v1/chat/completions",
             {"model": model, "messages": chat, "max_tokens": max_len + 10}),
        post("bad_prompt_plus_max_tokens_over_context", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": max_len - 5, "ignore_eos": True}, True),
        post("bad_chat_prompt_plus_max_tokens_over_context", "/v1/chat/completions",
             {"model": model, "messages": chat, "max_tokens": max_len - 5, "ignore_eos": True}, True),
        post("bad_prompt_over_max_model_len", "/v1/completions",
             {"model": model, "prompt": words(max_len + 100), "max_tokens": 4}),
        Exchange("bad_invalid_json", "POST", "/v1/completions", raw=b'{"model": "qwq", "prompt": "w1 w2",'),
        Exchange("bad_json_array_body", "POST", "/v1/completions", raw=b"[1, 2, 3]"),
        Exchange("bad_wrong_content_type", "POST", "/v1/completions", content_type="text/plain",
                 raw=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()),
        Exchange("bad_no_content_type", "POST", "/v1/completions", content_type=None,
                 raw=json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()),
        post("bad_negative_max_tokens", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": -5}),
        post("bad_zero_max_tokens", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 0}),
        post("bad_temperature_string", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": "hot"}),
        post("temperature_numeric_string", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": "0.5",
              "ignore_eos": True}, True),
        post("bad_max_tokens_string", "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": "four"}),
        Exchange("bad_get_on_completions", "GET", "/v1/completions", content_type=None),
    ]


def send(address: str, ex: Exchange, timeout: float = 300.0) -> Answer:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        payload = ex.raw if ex.raw is not None else (
            json.dumps(ex.body).encode() if ex.body is not None else None)
        headers = {"Content-Type": ex.content_type} if payload is not None and ex.content_type else {}
        conn.request(ex.method, ex.path, body=payload, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def sse_events(body: bytes) -> tuple[list[Any], list[str]]:
    """The JSON events of an SSE body and the framing faults found (empty when well framed)."""
    text = body.decode()
    faults = []
    if not text.endswith("data: [DONE]\n\n"):
        faults.append("does not end with 'data: [DONE]' and a blank line")
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if not block.startswith("data: ") or "\n" in block:
            faults.append(f"event is not one 'data: ' line: {block[:60]!r}")
            continue
        data = block[len("data: "):]
        if data != "[DONE]":
            events.append(json.loads(data))
    return events, faults


def _stream_shape(events: list[dict], counts: bool) -> dict:
    with_choices = [e for e in events if e.get("choices")]
    usage = [e for e in events if "usage" in e and e.get("usage")]
    first = with_choices[0]["choices"][0] if with_choices else {}
    finish = [c.get("finish_reason") for e in with_choices for c in e["choices"] if c.get("finish_reason")]
    shape = {
        "objects": sorted({e.get("object") for e in events}),
        "first_delta": first.get("delta") if "delta" in first else None,
        "finish_reasons": finish,
        "finish_on_last_choice_chunk": bool(with_choices) and
        with_choices[-1]["choices"][0].get("finish_reason") is not None,
        "usage_chunks": [{"choices": e["choices"], "usage_keys": sorted(e["usage"])} for e in usage],
        "usage_is_last": not usage or events[-1] is usage[-1],
        "one_id": len({e.get("id") for e in events}) == 1,
    }
    if counts:
        # one chunk per generated token (plus the chat stream's role opener)
        shape["choice_chunks"] = len(with_choices)
        shape["usage"] = [e["usage"] for e in usage]
    return shape


def _json_shape(doc: Any, counts: bool) -> dict:
    if not isinstance(doc, dict):
        return {"json": type(doc).__name__}
    if "error" in doc:
        err = doc["error"]
        return {"error": {k: err.get(k) for k in ("type", "param", "code", "message")}}
    if "detail" in doc:
        return {"detail": doc["detail"]}
    obj = doc.get("object")
    if obj in ("text_completion", "chat.completion"):
        choice = doc["choices"][0]
        shape = {"object": obj, "n_choices": len(doc["choices"]),
                 "finish_reason": choice.get("finish_reason"),
                 "usage_keys": sorted(k for k, v in doc["usage"].items() if v is not None)}
        if obj == "chat.completion":
            shape["message_role"] = choice["message"]["role"]
            shape["content_is_str"] = isinstance(choice["message"]["content"], str)
        else:
            shape["text_is_str"] = isinstance(choice.get("text"), str)
        if counts:
            shape["usage"] = {k: doc["usage"][k] for k in
                              ("prompt_tokens", "completion_tokens", "total_tokens")}
        return shape
    if obj == "list":
        return {"object": "list", "models": [
            {"id": m["id"], "object": m["object"], "owned_by": m["owned_by"],
             "max_model_len": m.get("max_model_len")} for m in doc["data"]]}
    if "tokens" in doc:
        shape = {"keys": sorted(doc), "count_matches": doc["count"] == len(doc["tokens"]),
                 "max_model_len": doc["max_model_len"]}
        if counts:
            shape["count"] = doc["count"]
        return shape
    return {"keys": sorted(doc)}


def shape(ex: Exchange, answer: Answer, counts: bool, eos: bool = True) -> dict:
    """What must agree between two servers for this exchange. `counts`: compare token counts
    too (both servers tokenize workload words the same way); `eos`: compare finish reasons."""
    counts = counts and ex.counts
    out = _shape(ex, answer, counts)
    if not eos:
        out.pop("finish_reason", None)
        out.get("stream", {}).pop("finish_reasons", None)
    return out


def _shape(ex: Exchange, answer: Answer, counts: bool) -> dict:
    ctype = answer.headers.get("content-type", "")
    out: dict = {"status": answer.status}
    if ex.name == "health":
        return out
    out["content_type"] = ctype.split(";")[0].strip()
    if out["content_type"] == "text/event-stream":
        out["charset"] = "charset=utf-8" in ctype
        events, faults = sse_events(answer.body)
        out["sse_faults"] = faults
        out["stream"] = _stream_shape(events, counts)
    elif out["content_type"] == "application/json":
        out.update(_json_shape(json.loads(answer.body), counts))
    return out
