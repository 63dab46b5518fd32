-- The token budget's side of the gateway's Lua (components/token-budget); base/gateway's
-- token-accounting.lua reads the responses' usage and writes the charge at their end (`settle`).
-- Envoy's rate limit filter charges the budget by what these write into the request's dynamic
-- metadata (namespace llm-serving.tokens):
--   admission  `prompt` (here): an upper estimate of the prompt's tokens, one per 4 bytes of the
--              request body (Envoy has no tokenizer; a token is at least ~4 bytes of English text,
--              JSON keys make the body longer than the prompt), charged before the picker runs;
--   stream end `settle` (token-accounting.lua): the completion's tokens from the response's usage
--              plus the prompt's tokens from usage beyond this estimate.
-- It also makes the gateway's own refusals say why (below): a request no API key authenticated, and
-- the two 429s (the token budget, the request rate limit), as OpenAI-style JSON errors.
local NS = "llm-serving.tokens"

local function openai_error(message, kind, code)
  return string.format('{"error":{"message":"%s","type":"%s","param":null,"code":"%s"}}', message, kind, code)
end

-- Envoy Gateway answers 500 on a route whose SecurityPolicy is invalid (the key Secret missing), but
-- as the route's direct response, after every filter before the router, the picker's ext_proc
-- included. This filter runs after authentication and before the rate limits and the picker: a
-- request without the client id only the API-key filter sets (components/edge-security removes a
-- client-sent one first) was authenticated by nobody, and is refused here, before the picker sees it.

function envoy_on_request(handle)
  if handle:headers():get("x-client-id") == nil then
    handle:respond({[":status"] = "500", ["content-type"] = "application/json"}, openai_error(
      "The gateway cannot authenticate requests (its API-key configuration is missing or invalid), "
      .. "so it serves none.", "server_error", "authentication_unavailable"))
    return
  end
  local body = handle:body()
  local bytes = 0
  if body ~= nil then
    bytes = body:length()
  end
  handle:streamInfo():dynamicMetadata():set(NS, "prompt", math.ceil(bytes / 4))
end

-- The global rate limit's refusal has an empty body and the budget's x-ratelimit-* headers
-- (`<tokens>, <tokens>;w=<window seconds>`, 0 remaining, seconds until the window ends); the
-- request rate limit's (the local rate limit) has the body `local_rate_limited`. The picker's own
-- 429 (a saturated pool) is JSON already and is left as it is. Both rate limit filters run after
-- this one, so their replies pass through here on their way out.
local function explain_refusal(handle)
  local body = handle:body()
  local headers = handle:headers() -- after body(), which may yield
  local text = body and body:getBytes(0, body:length()) or ""
  local message, code
  if text == "" then
    local budget, window = string.match(headers:get("x-ratelimit-limit") or "", "(%d+);w=(%d+)")
    if budget == nil or headers:get("x-ratelimit-remaining") ~= "0" then
      return -- not the budget's refusal (the budget's headers are on every answer it let through)
    end
    message = string.format("Token budget exceeded: this client's budget of %s tokens per %s s is used up; "
      .. "the window ends in %s s.", budget, window, headers:get("x-ratelimit-reset") or "?")
    code = "token_budget_exceeded"
  elseif text == "local_rate_limited" then
    message = "Too many requests: this client is over its request rate limit (requests per minute)."
    code = "request_rate_limited"
  else
    return
  end
  headers:replace("content-type", "application/json")
  handle:body(true):setBytes(openai_error(message, "rate_limit_error", code))
end

function envoy_on_response(handle)
  if handle:headers():get(":status") == "429" then
    explain_refusal(handle)
  end
end
