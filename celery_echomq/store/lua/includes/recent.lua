-- index_recent(recent, parent_id, max_age_ms, max_len): put a flow's parent in its queue's
-- recent-flow index (a zset) and trim the index by age and by length, so it never grows
-- without bound. It is an index for people (the dashboard's pages), not a state set: nothing
-- claims or recovers from it, and a held parent stays in no state set. The score is the
-- server time in microseconds (exact in a double), so flows enqueued within one millisecond
-- still list, and are trimmed, in their order. Three commands per flow, none per child, and
-- the script's one clock reading (includes/now_ms.lua).
--- @include "now_ms"
local function index_recent(recent, parent_id, max_age_ms, max_len)
  local t = server_time()
  -- Strings, not Lua numbers: Redis would print a number with 14 significant digits.
  local score = t[1] .. string.format('%06d', tonumber(t[2]))
  local cutoff = string.format('%.0f', tonumber(score) - max_age_ms * 1000)
  redis.call('ZADD', recent, score, parent_id)
  redis.call('ZREMRANGEBYSCORE', recent, '-inf', '(' .. cutoff)
  redis.call('ZREMRANGEBYRANK', recent, 0, -(max_len + 1))
end
