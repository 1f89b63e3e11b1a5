-- credit: the fan-in on the parent's slot for a child that lives on another slot. The
-- child's own complete/fail already ran on its slot and staged the outcome in its queue's
-- outbox; this applies it to the parent exactly once per child id (:settled), whatever
-- recovery or a redelivery repeats.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies
-- KEYS[3]  the parent's :processed
-- KEYS[4]  the parent's :ignored
-- KEYS[5]  the parent's :settled (child id -> outcome: what makes the credit idempotent)
-- KEYS[6]  the parent queue's pending set
-- KEYS[7]  the parent queue's failed set
-- ARGV[1]  parent id
-- ARGV[2]  child id
-- ARGV[3]  outcome: "done" or "failed"
-- ARGV[4]  the child's value (done) or "ExcType: message" (failed)
-- ARGV[5]  the child's parent_policy ('' for the flow's default)
-- ARGV[6]  result TTL in seconds
--
-- Reply: {status, policy}
--   "released"       the parent is now pending (the host dispatches it)
--   "credited"       counted; the parent still waits, or no longer waits
--   "parent_failed"  policy fail: the parent is failed (the host records FAILURE for it)
--   "duplicate"      this child was credited before: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' or string.sub(ARGV[2], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
if redis.call('HSETNX', KEYS[5], ARGV[2], ARGV[3]) == 0 then
  return {'duplicate', ''}
end
local ttl = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local waiting = redis.call('HGET', KEYS[1], 'state') == 'awaiting_children'
local policy = ''

local function release()
  redis.call('ZADD', KEYS[6], now, ARGV[1])
  redis.call('HSET', KEYS[1], 'state', 'pending')
  redis.call('EXPIRE', KEYS[5], ttl)
  return {'released', policy}
end

if ARGV[3] == 'done' then
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
else
  policy = ARGV[5]
  if policy == '' then
    policy = redis.call('HGET', KEYS[1], 'policy') or 'fail'
  end
  if policy == 'fail' then
    if not waiting then
      return {'credited', policy}
    end
    redis.call('HSET', KEYS[1], 'state', 'failed', 'failed_child', ARGV[2],
      'error', 'child ' .. ARGV[2] .. ' failed: ' .. ARGV[4])
    redis.call('ZADD', KEYS[7], now, ARGV[1])
    for i = 1, 5 do
      redis.call('EXPIRE', KEYS[i], ttl)
    end
    return {'parent_failed', policy}
  end
  if policy == 'ignore' then
    redis.call('HSET', KEYS[4], ARGV[2], ARGV[4])
  end
end
local left = redis.call('DECR', KEYS[2])
redis.call('HINCRBY', KEYS[1], 'credited', 1)
if waiting and (policy == 'continue' or left <= 0) then
  return release()
end
return {'credited', policy}
