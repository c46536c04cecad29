-- wrk script: POST an OpenAI /v1/completions body to kvroute (or a pod).
--   wrk -t2 -c32 -d30s -s bench/wrk/completions.lua http://127.0.0.1:8000
-- Each request carries one of 64 shared system prompts plus a distinct
-- question, so a prefix-aware router has something to route on. Set
-- WRK_PROMPT_BYTES to change the prompt size (default 1024).
local prompt_bytes = tonumber(os.getenv("WRK_PROMPT_BYTES") or "1024")
local groups = 64
local counter = 0

local function system_prompt(g)
  local unit = string.format("System prompt %d: answer briefly and cite sources. ", g)
  return string.rep(unit, math.floor(prompt_bytes / #unit) + 1):sub(1, prompt_bytes)
end

local prompts = {}
for g = 1, groups do prompts[g] = system_prompt(g) end

wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.headers["Content-Type"] = "application/json"

request = function()
  counter = counter + 1
  local g = (counter % groups) + 1
  local body = string.format(
    '{"model":"m","prompt":"%s Question %d?","max_tokens":16,"stream":false}',
    prompts[g], counter)
  return wrk.format(nil, nil, nil, body)
end
