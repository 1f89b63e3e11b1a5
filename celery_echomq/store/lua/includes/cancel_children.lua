--- @include "unwait"
--- @include "keys"
-- cancel_children(first_key, first_arg, pending, active, counters, ttl, reply, started,
-- parent_id): every child whose row is KEYS[first_key..] (ids in ARGV[first_arg..], in the
-- same order) and that has not finished (pending, a held nested flow, a chain's waiting step,
-- a chain's step handed out that no delivery took, and when ``started`` also active) becomes
-- cancelled: no later claim runs it and no completion counts it. Its id
-- leaves the state sets, its row expires with the flow, a held nested flow counts one parent
-- fewer held, a child waiting for a slot of its flow's window one fewer waiting (unwait), and
-- its id is appended to ``reply`` (the host revokes its message). A row whose
-- own 'parent' is not ``parent_id`` is left alone: the row decides whose child it is; so is a
-- job joined to more parents (its '<row>:parents', named from its row by includes/keys.lua:
-- on_exists="join"), which another flow may still wait for. cancel,
-- release --revoke and cancel_elsewhere share it, so each stops a child alike on every slot.
-- Returns the ids of the flow's children it cancelled, what their parent counts as cut: a
-- linked chain is one child however many of its steps it cancels (its last, with no 'next').
local function cancel_children(first_key, first_arg, pending, active, counters, ttl, reply,
    started, parent_id)
  local children = {}
  for i = 0, #KEYS - first_key do
    local row, cid = KEYS[first_key + i], ARGV[first_arg + i]
    local c = redis.call('HMGET', row, 'state', 'parent', 'token', 'chain', 'next')
    local cstate = c[1]
    -- An active row with no token is a chain's step handed out that no delivery took yet.
    if c[2] == parent_id and (cstate == 'pending' or cstate == 'awaiting_children'
        or cstate == 'waiting' or (cstate == 'active' and (started or not c[3])))
        and redis.call('EXISTS', parents_of(row)) == 0 then
      redis.call('HSET', row, 'state', 'cancelled')
      if cstate == 'awaiting_children' then
        redis.call('HINCRBY', counters, 'held', -1)
      end
      left_window(counters, cstate, c[4])
      redis.call('ZREM', pending, cid)
      redis.call('ZREM', active, cid)
      redis.call('EXPIRE', row, ttl)
      reply[#reply + 1] = cid
      if not c[5] then
        children[#children + 1] = cid
      end
    end
  end
  return children
end
