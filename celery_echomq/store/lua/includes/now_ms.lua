-- now_ms(): the server's clock in ms (Redis TIME), read once per script: a script is one
-- atomic step, so every "when" it writes is the same instant. Every score that says "when"
-- uses it, so that no two hosts' clocks are ever compared.
local now_ms_read
local function now_ms()
  if not now_ms_read then
    local t = redis.call('TIME')
    now_ms_read = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms_read
end
