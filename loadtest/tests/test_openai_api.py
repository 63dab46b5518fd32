import pytest

from loadtest.openai_api import DONE, SSEDecoder, SSEError, error_reason, request_body
from loadtest.prompts import PromptSpec


def feed_all(lines):
    dec, events = SSEDecoder(), []
    for line in lines:
        ev = dec.feed(line)
        if ev is not None:
            events.append(ev)
    return dec, events


def test_decoder_events_comments_multiline_and_done():
    dec, events = feed_all([b": keep-alive\n", b"\n", b'data: {"choices": [1]}\r\n', b"\n",
                            b"event: x\n", b'data: {"a":\n', b"data: 2}\n", b"\n",
                            b"data: [DONE]\n", b"\n"])
    assert events == [{"choices": [1]}, {"a": 2}, DONE] and dec.done


def test_decoder_last_event_without_blank_line_is_flushed_on_close():
    dec, events = feed_all([b'data: {"usage": {}}\n'])
    assert events == [] and dec.close() == {"usage": {}}


def test_decoder_rejects_broken_json_and_reports_stream_errors():
    with pytest.raises(SSEError, match="broken SSE: not JSON"):
        feed_all([b"data: {oops\n", b"\n"])
    with pytest.raises(SSEError, match="server error in stream: overloaded"):
        feed_all([b'data: {"error": {"message": "overloaded"}}\n', b"\n"])
    with pytest.raises(SSEError, match="not an object"):
        feed_all([b"data: [1, 2]\n", b"\n"])


def test_request_bodies_follow_vllm_benchmark():
    spec = PromptSpec(prompt="a b c", prompt_tokens=3, output_tokens=7,
                      messages=[{"role": "system", "content": "s"}])
    comp = request_body(spec, "completions", "qwq")
    assert comp["prompt"] == "a b c" and comp["max_tokens"] == 7 and comp["ignore_eos"]
    assert comp["stream"] and comp["stream_options"] == {"include_usage": True}
    chat = request_body(spec, "chat", "qwq")
    assert chat["messages"] == spec.messages and chat["max_completion_tokens"] == 7
    plain = request_body(PromptSpec("x y", 2, 1), "chat", "m")
    assert plain["messages"] == [{"role": "user", "content": "x y"}]
    with pytest.raises(ValueError, match="endpoint"):
        request_body(spec, "embeddings", "qwq")


def test_error_reason_extracts_the_server_message():
    assert error_reason(429, b'{"error": {"message": "shed:  pool saturated"}}') == \
        "HTTP 429: shed: pool saturated"
    assert error_reason(503, b"no healthy upstream") == "HTTP 503: no healthy upstream"
    assert error_reason(500, b"") == "HTTP 500"
