-- cut_pending(row, cid, parent_id, pending, ttl, error): a child of ``parent_id`` that has not
-- started (its row is pending: its message not yet run, or waiting for a retry's countdown)
-- becomes cancelled, marked ``cut = deadline`` with ``error``: no later claim runs it and no
-- completion counts it. Its id leaves the pending set and its row expires with the flow.
-- Returns true when it was cut. deadline (on the parent's slot) and deadline_cut (on a
-- child's other slot) share it, so both stop a child alike.
local function cut_pending(row, cid, parent_id, pending, ttl, error)
  local c = redis.call('HMGET', row, 'state', 'parent')
  if c[1] ~= 'pending' or c[2] ~= parent_id then
    return false
  end
  redis.call('HSET', row, 'state', 'cancelled', 'cut', 'deadline', 'error', error)
  redis.call('ZREM', pending, cid)
  redis.call('EXPIRE', row, ttl)
  return true
end
