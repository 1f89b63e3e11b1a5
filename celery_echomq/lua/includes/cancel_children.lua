-- cancel_children(first_key, first_arg, pending, active, counters, ttl, reply): every child
-- whose row is KEYS[first_key..] (ids in ARGV[first_arg..], in the same order) and that has not
-- finished (pending, active, or a held nested flow) becomes cancelled: no later claim runs it
-- and no completion counts it. Its id leaves the state sets, its row expires with the flow,
-- a held nested flow counts one parent fewer held, and its id is appended to ``reply`` (the
-- host revokes its message). cancel and release --revoke share it, so both stop a child alike.
local function cancel_children(first_key, first_arg, pending, active, counters, ttl, reply)
  for i = 0, #KEYS - first_key do
    local row, cid = KEYS[first_key + i], ARGV[first_arg + i]
    local cstate = redis.call('HGET', row, 'state')
    if cstate == 'pending' or cstate == 'active' or cstate == 'awaiting_children' then
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
