-- claim: a worker starts a job (task_prerun): pending -> active under a new token.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set (score: the deadline after which recovery treats the job as lost)
-- ARGV[1]  job id
-- ARGV[2]  the new token
-- ARGV[3]  lease in ms: the deadline is server time + lease
--
-- Reply: {status, attempts}
--   "claimed"     pending -> active
--   "taken_over"  it was active under another token (a redelivery): that token is now stale
--   "done" | "failed" | "cancelled"   already finished: nothing changed
--   "held"        a parent still awaiting its children: nothing changed
--   "missing"     no row (never written, or expired): nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
local row = redis.call('HMGET', KEYS[1], 'state', 'attempts')
local state = row[1]
if not state then
  return {'missing', 0}
end
if state == 'awaiting_children' then
  return {'held', 0}
end
if state ~= 'pending' and state ~= 'active' then
  return {state, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local attempts = (tonumber(row[2]) or 0) + 1
redis.call('HSET', KEYS[1], 'state', 'active', 'token', ARGV[2], 'started', now,
  'attempts', attempts)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[1])
if state == 'active' then
  return {'taken_over', attempts}
end
return {'claimed', attempts}
