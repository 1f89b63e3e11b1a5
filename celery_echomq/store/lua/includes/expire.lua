-- expire_keys(ttl, keys): EXPIRE every key of the list ``keys`` (a finished job's row, and a
-- finished flow's :dependencies, :processed, :ignored, ...): nothing outlives the result TTL.
--
-- A parent's indexes for operators' pages: '<its row>:children', the list of its children
-- by position (written with them: enqueue_flow, grow_flow, the host on the chunked path), and
-- '<its row>:failures', the ids of its children failed under fail, remove or continue
-- (settle_child); '<its row>:window' and ':slots', its window (includes/window.lua);
-- '<its row>:quorum', its successes in order under a quorum (includes/quorum.lua).
-- Their names are derived from the flow's ':dependencies' (the same hash
-- tag, so the same slot; includes/keys.lua): they expire and persist wherever it does, and no
-- caller passes them.
--- @include "keys"
local function indexes_of(key)
  local row = row_of_dependencies(key)
  if row then
    return {children_of(row), failures_of(row), window_of(row), slots_of(row), quorum_of(row)}
  end
  return {}
end

local function expire_keys(ttl, keys)
  for _, key in ipairs(keys) do
    redis.call('EXPIRE', key, ttl)
    for _, index in ipairs(indexes_of(key)) do
      redis.call('EXPIRE', index, ttl)
    end
  end
end

-- persist_keys(keys): PERSIST every key of ``keys`` (a flow held again), its indexes with them.
local function persist_keys(keys)
  for _, key in ipairs(keys) do
    redis.call('PERSIST', key)
    for _, index in ipairs(indexes_of(key)) do
      redis.call('PERSIST', index)
    end
  end
end
