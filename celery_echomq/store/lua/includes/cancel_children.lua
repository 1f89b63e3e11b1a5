-- cancel_children(first_key, first_arg, pending, active, counters, ttl, reply, started,
-- parent_id): every child whose row is KEYS[first_key..] (ids in ARGV[first_arg..], in the
-- same order) and that has not finished (pending, a held nested flow, a chain's waiting step,
-- and when ``started`` also active) becomes cancelled: no later claim runs it and no completion counts it. Its id
-- leaves the state sets, its row expires with the flow, a held nested flow counts one parent
-- fewer held, and its id is appended to ``reply`` (the host revokes its message). A row whose
-- own 'parent' is not ``parent_id`` is left alone: the row decides whose child it is. cancel,
-- release --revoke and cancel_elsewhere share it, so each stops a child alike on every slot.
local function cancel_children(first_key, first_arg, pending, active, counters, ttl, reply,
    started, parent_id)
  for i = 0, #KEYS - first_key do
    local row, cid = KEYS[first_key + i], ARGV[first_arg + i]
    local c = redis.call('HMGET', row, 'state', 'parent')
    local cstate = c[1]
    if c[2] == parent_id and (cstate == 'pending' or cstate == 'awaiting_children'
        or cstate == 'waiting' or (started and cstate == 'active')) then
      redis.call('HSET', row, 'state', 'cancelled')
      if cstate == 'awaiting_children' then
        redis.call('HINCRBY', counters, 'held', -1)
      end
      redis.call('ZREM', pending, cid)
      redis.call('ZREM', active, cid)
      redis.call('EXPIRE', row, ttl)
      reply[#reply + 1] = cid
    end
  end
end
