-- Token accounting for the per-client token budget (components/token-budget). Envoy's rate limit
-- filter charges the budget by what this script writes into the request's dynamic metadata
-- (namespace llm-serving.tokens):
--   admission  `prompt`: an upper estimate of the prompt's tokens, one per 4 bytes of the request
--              body (Envoy has no tokenizer; a token is at least ~4 bytes of English text, JSON
--              keys make the body longer than the prompt), charged before the picker runs;
--   stream end `settle`: the completion's tokens from the response's `usage` (the last SSE chunk
--              when streamed with stream_options.include_usage), plus the prompt's tokens from
--              `usage` beyond the admission estimate. A streamed response without usage is
--              charged one token per SSE event that carries choices (vLLM sends at least one token
--              per event).
local NS = "llm-serving.tokens"
local TAIL = 256 -- bytes kept between chunks, so a usage field split across two chunks is found

function envoy_on_request(handle)
  local body = handle:body()
  local bytes = 0
  if body ~= nil then
    bytes = body:length()
  end
  handle:streamInfo():dynamicMetadata():set(NS, "prompt", math.ceil(bytes / 4))
end

local function last_number(text, field)
  local found = nil
  for n in string.gmatch(text, '"' .. field .. '"%s*:%s*(%d+)') do
    found = tonumber(n)
  end
  return found
end

function envoy_on_response(handle)
  handle:streamInfo():dynamicMetadata():set(NS, "settle", 0)
  local carry, completion, prompt, events = "", nil, nil, 0
  for chunk in handle:bodyChunks() do
    local text = carry .. chunk:getBytes(0, chunk:length())
    completion = last_number(text, "completion_tokens") or completion
    prompt = last_number(text, "prompt_tokens") or prompt
    for _ in string.gmatch(chunk:getBytes(0, chunk:length()), 'data: {[^\n]-"choices"%s*:%s*%[%s*{') do
      events = events + 1
    end
    carry = string.sub(text, -TAIL)
  end
  -- objects Envoy hands out are only valid until the script yields (bodyChunks does): ask again
  local metadata = handle:streamInfo():dynamicMetadata()
  local charged = (metadata:get(NS) or {})["prompt"] or 0
  local settle = completion or events
  if prompt ~= nil and prompt > charged then
    settle = settle + prompt - charged
  end
  metadata:set(NS, "settle", settle)
end
