-- server_time(): the server's clock as Redis TIME gives it ({seconds, microseconds}), read
-- once per script: a script is one atomic step, so every "when" it writes is the same
-- instant. now_ms(): the same reading in ms. Every score that says "when" uses one of them,
-- so that no two hosts' clocks are ever compared, and no script reads TIME itself.
local server_time_read
local function server_time()
  if not server_time_read then
    server_time_read = redis.call('TIME')
  end
  return server_time_read
end

local function now_ms()
  local t = server_time()
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
