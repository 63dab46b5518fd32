-- Token accounting of every response on the routes whose EnvoyExtensionPolicy runs it (the picker's
-- route, base/gateway; both routes with components/token-budget). It reads the response as it
-- streams past (never holding it) and writes into the request's dynamic metadata, namespace
-- llm-serving.tokens, when the response ends:
--   prompt_tokens, completion_tokens  the response's `usage` (the JSON body, or the last SSE chunk
--                                     when streamed with stream_options.include_usage);
--   first_token_us                    when the first SSE event with a choice passed through here
--                                     (microseconds since the epoch; streamed responses only);
--   settle                            what components/token-budget charges at the end: the
--                                     completion's tokens (without usage, one per SSE event with a
--                                     choice: vLLM sends at least one token per event) plus the
--                                     prompt's beyond the admission estimate `prompt` (if any).
-- Envoy's access log (the picker's outcome port, base/gateway/envoy-proxy.yaml) carries these to
-- the picker with the request's other dynamic metadata; the token budget's rate limit charges
-- `settle`. Error responses (status 300 and above) carry no usage and are not read.
local NS = "llm-serving.tokens"
local TAIL = 256 -- bytes kept between chunks, so a usage field split across two chunks is found
local EVENT = 'data: {[^\n]-"choices"%s*:%s*%[%s*{' -- an SSE event with at least one choice
local MAX_LINE = 65536 -- an unfinished SSE line kept between chunks (events are far shorter)

local function last_number(text, field)
  local found = nil
  for n in string.gmatch(text, '"' .. field .. '"%s*:%s*(%d+)') do
    found = tonumber(n)
  end
  return found
end

function envoy_on_response(handle)
  -- nothing to settle unless the response ends (a client gone mid-stream is charged no completion)
  handle:streamInfo():dynamicMetadata():set(NS, "settle", 0)
  local headers = handle:headers()
  local status = tonumber(headers:get(":status")) or 0
  if status >= 300 then
    return
  end
  local sse = string.find(headers:get("content-type") or "", "text/event-stream", 1, true) ~= nil
  local carry, line, completion, prompt, events, first = "", "", nil, nil, 0, nil
  for chunk in handle:bodyChunks() do
    local bytes = chunk:getBytes(0, chunk:length())
    local text = carry .. bytes
    if string.find(text, '"usage"', 1, true) then
      completion = last_number(text, "completion_tokens") or completion
      prompt = last_number(text, "prompt_tokens") or prompt
    end
    carry = string.sub(text, -TAIL)
    if sse then -- whole lines only: an event cut across two chunks counts once, when complete
      local lines = line .. bytes
      local cut = string.find(lines, "\n[^\n]*$")
      line = cut and string.sub(lines, cut + 1) or string.sub(lines, -MAX_LINE)
      for _ in string.gmatch(cut and string.sub(lines, 1, cut) or "", EVENT) do
        events = events + 1
      end
      if first == nil and events > 0 then
        first = tonumber(handle:timestampString(EnvoyTimestampResolution.MICROSECOND))
      end
    end
  end
  -- objects Envoy hands out are only valid until the script yields (bodyChunks does): ask again
  local metadata = handle:streamInfo():dynamicMetadata()
  local charged = (metadata:get(NS) or {})["prompt"] or 0
  local settle = completion or events
  if prompt ~= nil and prompt > charged then
    settle = settle + prompt - charged
  end
  metadata:set(NS, "settle", settle)
  if prompt ~= nil then
    metadata:set(NS, "prompt_tokens", prompt)
  end
  if completion ~= nil then
    metadata:set(NS, "completion_tokens", completion)
  end
  if first ~= nil then
    metadata:set(NS, "first_token_us", first)
  end
end
