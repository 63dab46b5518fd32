"""base/gateway's token-accounting.lua in a real Lua runtime (lupa) against a stand-in for Envoy's
stream handle (the real Envoy runs it in tests/e2e/test_e2e_outcomes.py and the token-budget e2e):
what it writes into llm-serving.tokens for streamed and whole bodies, usage split across chunks,
no usage, and error statuses."""
from __future__ import annotations

import json

import pytest
from lupa import LuaRuntime

from tests.policy.conftest import find, rendered

# Envoy's handle, as much of it as the script uses: headers, streamed body chunks, a clock that
# ticks once per call (microseconds since the epoch, as a string), dynamic metadata.
HANDLE = """
EnvoyTimestampResolution = {MILLISECOND = 0, MICROSECOND = 1}
function make_handle(status, content_type, chunks, start_us)
  local md, clock, stamps = {}, start_us, {}
  local h = {}
  function h:headers()
    return {get = function(_, name)
      if name == ":status" then return status end
      if name == "content-type" then return content_type end
      return nil
    end}
  end
  function h:bodyChunks()
    local i = 0
    return function()
      i = i + 1
      clock = clock + 1000
      if chunks[i] == nil then return nil end
      local bytes = chunks[i]
      return {length = function() return #bytes end,
              getBytes = function(_, from, n) return string.sub(bytes, from + 1, from + n) end}
    end
  end
  function h:timestampString(resolution)
    assert(resolution == EnvoyTimestampResolution.MICROSECOND)
    table.insert(stamps, clock)
    return string.format("%d", clock)
  end
  function h:streamInfo()
    return {dynamicMetadata = function()
      return {get = function(_, ns) return md[ns] end,
              set = function(_, ns, k, v) md[ns] = md[ns] or {}; md[ns][k] = v end}
    end}
  end
  h.md = md
  return h
end
"""


@pytest.fixture(scope="module")
def script() -> str:
    return find(rendered("overlays/a10-open-gateway"), "ConfigMap", "token-accounting")["data"]["lua"]


def run(script, chunks, status="200", content_type="text/event-stream", prompt_estimate=None,
        start_us=1_800_000_000_000_000):
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.execute(HANDLE)
    lua.execute(script)
    handle = lua.globals().make_handle(status, content_type, lua.table_from(chunks), start_us)
    if prompt_estimate is not None:
        handle.md["llm-serving.tokens"] = lua.table_from({"prompt": prompt_estimate})
    lua.globals().envoy_on_response(handle)
    tokens = handle.md["llm-serving.tokens"]
    return dict(tokens.items()) if tokens is not None else {}


def sse(*events) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


TOKEN = {"choices": [{"index": 0, "text": "a"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 3, "total_tokens": 123}}


def test_streamed_with_usage(script):
    body = sse(TOKEN, TOKEN, TOKEN, USAGE)
    chunks = [body[:15], body[15:90], body[90:]]  # usage and events cut across chunks
    out = run(script, chunks)
    assert out == {"prompt_tokens": 120, "completion_tokens": 3, "settle": 123,
                   "first_token_us": 1_800_000_000_000_000 + 2000}  # the 1st event ends in chunk 2


def test_the_first_token_is_the_first_event_with_a_choice(script):
    role_only = {"choices": []}  # an event with no choice is not a token
    out = run(script, [sse(role_only)[:-len("data: [DONE]\n\n")], sse(TOKEN, USAGE)])
    assert out["first_token_us"] == 1_800_000_000_000_000 + 2000


def test_usage_split_inside_a_number_is_still_found(script):
    body = sse(TOKEN, USAGE)
    cut = body.index('"completion_tokens": 3') + len('"completion_tok')
    assert run(script, [body[:cut], body[cut:]])["completion_tokens"] == 3


def test_streamed_without_usage_charges_one_token_per_event(script):
    body = sse(TOKEN, TOKEN, TOKEN)
    cuts = [0, 10, 50, 51, 70, len(body)]  # events cut anywhere count once each
    out = run(script, [body[a:b] for a, b in zip(cuts, cuts[1:])])
    assert out == {"settle": 3, "first_token_us": 1_800_000_000_000_000 + 2000}


def test_a_whole_json_body_has_usage_and_no_first_token(script):
    body = json.dumps({"choices": [{"text": "abc"}], **{k: v for k, v in USAGE.items() if k == "usage"}})
    out = run(script, [body], content_type="application/json")
    assert out == {"prompt_tokens": 120, "completion_tokens": 3, "settle": 123}


def test_prompt_beyond_the_budget_estimate_is_settled(script):
    out = run(script, [sse(TOKEN, USAGE)], prompt_estimate=100)
    assert out["settle"] == 3 + 20 and out["prompt"] == 100


@pytest.mark.parametrize("status", ["400", "429", "503"])
def test_error_statuses_are_not_read_and_charge_nothing(script, status):
    assert run(script, [json.dumps({"error": {"message": "x"}, "usage": {"completion_tokens": 9}})],
               status=status, content_type="application/json") == {"settle": 0}
