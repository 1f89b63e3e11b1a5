-- now_ms(): the server's clock in ms (Redis TIME). Every score that says "when" uses it, so
-- that no two hosts' clocks are ever compared.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
