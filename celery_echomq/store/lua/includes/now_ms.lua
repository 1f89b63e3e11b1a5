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

-- now_text(): now_ms() as the decimal string Redis stores, made once per script. What a
-- script passes to redis.call goes as a string: a Lua number is printed there with '%.17g',
-- which costs the server several times what '%d' does (the same digits for these integers).
local now_text_made
local function now_text()
  if not now_text_made then
    now_text_made = string.format('%d', now_ms())
  end
  return now_text_made
end
