-- repend(child, cid, pending, failed, now, reply, ...): the row ``child`` (id ``cid``) runs
-- again as a new attempt: pending, without its error, holder and token (and the further
-- fields named in ``...``), no longer expiring, its id moved from ``failed`` to ``pending``,
-- and appended to ``reply`` with its stored payload, delta and input (a chain's step), for the host to re-publish.
-- retry_flow, retry_children and retry_deadline share it, so a retried child is alike
-- whichever repair made it pending. A chain's step persists the steps waiting behind it, which
-- its failure or cut had set to expire with it (includes/chain_rest.lua).
--- @include "chain_rest"
local function repend(child, cid, pending, failed, now, reply, ...)
  redis.call('HSET', child, 'state', 'pending')
  redis.call('HDEL', child, 'error', 'suspect', 'token', ...)
  redis.call('PERSIST', child)
  redis.call('ZREM', failed, cid)
  redis.call('ZADD', pending, now, cid)
  reply[#reply + 1] = cid
  local stored = redis.call('HMGET', child, 'payload', 'delta', 'input', 'next')
  if stored[4] then
    persist_steps_after(child, cid, stored[4])
  end
  reply[#reply + 1] = stored[1]
  reply[#reply + 1] = stored[2]
  reply[#reply + 1] = stored[3]
end
