--- @include "now_ms"
--- @include "keys"
-- stage_edges(row, id, index, edges, joined, ttl, value): a job that finished, and that was
-- joined to more parents than its first (on_exists="join": its '<row>:parents', KEYS-passed
-- as ``edges``; ``joined`` its row's 'joined' field, which join_edge sets with the first
-- edge, so that a job nobody joined costs no command here), is staged in its queue's index
-- of joined jobs to credit (``index``, score now): the host then credits each of those
-- parents (credit.lua, once per parent through its :settled), and recovery credits what a
-- host that died left staged. A done job keeps its value on its row for them. The edges
-- expire with the row. Returns whether it was staged. Callers run it once per finishing
-- transition (complete's was_active, fail's own failure).
local function stage_edges(row, id, index, edges, joined, ttl, value)
  if not index or not joined then
    return false
  end
  if value then
    redis.call('HSET', row, 'value', value)
  end
  redis.call('ZADD', index, now_ms(), id)
  redis.call('EXPIRE', edges, ttl)
  return true
end

-- joined_to(row, parent_id): whether the job of ``row`` was joined to ``parent_id`` after its
-- first parent (its '<row>:parents', named from its row by includes/keys.lua), and
-- then the policy of that edge ('' for that flow's default). An operator's retry of that
-- parent runs such a job again as it does its own children.
local function joined_to(row, parent_id)
  local spec = redis.call('HGET', parents_of(row), parent_id)
  if not spec then
    return false, nil
  end
  return true, string.match(spec, '^([^|]*)|')
end
