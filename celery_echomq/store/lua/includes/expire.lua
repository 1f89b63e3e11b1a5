-- expire_keys(ttl, keys): EXPIRE every key of the list ``keys`` (a finished job's row, and a
-- finished flow's :dependencies, :processed, :ignored, ...): nothing outlives the result TTL.
local function expire_keys(ttl, keys)
  for _, key in ipairs(keys) do
    redis.call('EXPIRE', key, ttl)
  end
end
