--- @include "now_ms"
-- release_parent(row, pending, parent_id, counters): the parent leaves awaiting_children for
-- its queue's pending set, where the host's dispatch finds it. Only a caller that saw the
-- parent awaiting_children in this same script calls it: that is what makes the release
-- happen once. ``counters`` (the queue's counters hash) counts the release and one parent
-- fewer held: what the dashboard's gauges read without scanning the keyspace.
local function release_parent(row, pending, parent_id, counters)
  redis.call('ZADD', pending, now_text(), parent_id)
  redis.call('HSET', row, 'state', 'pending')
  redis.call('HINCRBY', counters, 'released', '1')
  redis.call('HINCRBY', counters, 'held', '-1')
end

-- release_if_last(row, pending, parent_id, left, counters): release the parent when ``left``
-- (its counter, just decremented) reached zero and it still waits. Returns true when released.
local function release_if_last(row, pending, parent_id, left, counters)
  if left <= 0 and redis.call('HGET', row, 'state') == 'awaiting_children' then
    release_parent(row, pending, parent_id, counters)
    return true
  end
  return false
end
