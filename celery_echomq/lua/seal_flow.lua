-- seal_flow: the last step of the chunked path: every child was added, so remove the extra
-- unit open_flow put on the counter. If the children already all completed, release now.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies
-- KEYS[3]  the parent queue's pending set
-- KEYS[4]  the parent queue's open set
-- ARGV[1]  parent id
--
-- Reply: {status}
--   "released"  sealed, and nothing was outstanding: the parent is pending (host dispatches)
--   "sealed"    sealed; children outstanding
--   "noop"      not open (sealed before, or failed by recovery): nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
-- Leaving the open set is what makes the seal happen once.
if redis.call('ZREM', KEYS[4], ARGV[1]) == 0 then
  return {'noop'}
end
local left = redis.call('DECR', KEYS[2])
if left <= 0 and redis.call('HGET', KEYS[1], 'state') == 'awaiting_children' then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
  redis.call('HSET', KEYS[1], 'state', 'pending')
  return {'released'}
end
return {'sealed'}
