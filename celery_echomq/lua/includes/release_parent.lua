--- @include "now_ms"
-- release_parent(row, pending, parent_id): the parent leaves awaiting_children for its
-- queue's pending set, where the host's dispatch finds it. Only a caller that saw the parent
-- awaiting_children in this same script calls it: that is what makes the release happen once.
local function release_parent(row, pending, parent_id)
  redis.call('ZADD', pending, now_ms(), parent_id)
  redis.call('HSET', row, 'state', 'pending')
end

-- release_if_last(row, pending, parent_id, left): release the parent when ``left`` (its
-- counter, just decremented) reached zero and it still waits. Returns true when released.
local function release_if_last(row, pending, parent_id, left)
  if left <= 0 and redis.call('HGET', row, 'state') == 'awaiting_children' then
    release_parent(row, pending, parent_id)
    return true
  end
  return false
end
