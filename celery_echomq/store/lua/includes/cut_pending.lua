-- cut_pending(row, cid, parent_id, pending, ttl, error, counters): a child of ``parent_id`` that has not
-- started (its row is pending: its message not yet run, or waiting for a retry's countdown;
-- or waiting for a slot of its flow's window, with no message at all)
-- becomes cancelled, marked ``cut = deadline`` with ``error``: no later claim runs it and no
-- completion counts it. Its id leaves the pending set and its row expires with the flow.
-- One waiting for a slot of its window counts one fewer waiting in ``counters``, its queue's
-- (includes/unwait.lua). Returns true when it was cut. deadline (on the parent's slot) and deadline_cut (on a
-- child's other slot) share it, so both stop a child alike. A job other flows were joined
-- to (its '<row>:parents', named from its row: on_exists="join") is left to them. A chain's
-- step (with a 'next') expires the steps waiting behind it with it (includes/chain_rest.lua);
-- those steps (waiting, with a 'chain') are never cut themselves: they stay waiting behind the
-- cut step, so that a retry of it runs the rest of the chain.
--- @include "chain_rest"
--- @include "unwait"
--- @include "keys"
local function cut_pending(row, cid, parent_id, pending, ttl, error, counters)
  local c = redis.call('HMGET', row, 'state', 'parent', 'next', 'chain')
  local behind_a_step = c[1] == 'waiting' and c[4]
  if (c[1] ~= 'pending' and c[1] ~= 'waiting') or behind_a_step or c[2] ~= parent_id
      or redis.call('EXISTS', parents_of(row)) == 1 then
    return false
  end
  redis.call('HSET', row, 'state', 'cancelled', 'cut', 'deadline', 'error', error)
  left_window(counters, c[1], c[4])
  redis.call('ZREM', pending, cid)
  redis.call('EXPIRE', row, ttl)
  if c[3] then
    expire_steps_after(row, cid, c[3], ttl)
  end
  return true
end
