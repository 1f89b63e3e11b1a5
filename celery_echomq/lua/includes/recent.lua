-- index_recent(recent, parent_id, now, max_age_ms, max_len): put a flow's parent in its
-- queue's recent-flow index (a zset, score: enqueue time in ms) and trim the index by age and
-- by length, so it never grows without bound. It is an index for people (the dashboard's
-- pages), not a state set: nothing claims or recovers from it, and a held parent stays in no
-- state set. Three commands per flow, none per child.
local function index_recent(recent, parent_id, now, max_age_ms, max_len)
  redis.call('ZADD', recent, now, parent_id)
  redis.call('ZREMRANGEBYSCORE', recent, '-inf', now - max_age_ms)
  redis.call('ZREMRANGEBYRANK', recent, 0, -(max_len + 1))
end
