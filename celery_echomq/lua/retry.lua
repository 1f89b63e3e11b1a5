-- retry: Celery retries a job (task_retry): active -> pending, until its next delivery claims it.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set
-- ARGV[1]  job id
-- ARGV[2]  the token of the delivery that is retrying
-- ARGV[3]  ms until the retry is due (its countdown or eta; '0' when none): the job's
--          pending score is when it is due, so recovery does not take a long countdown for a
--          lost message
--
-- Reply: {status}
--   "retried"   active -> pending; attempts stay counted on the row
--   "stale"     another delivery holds the job now (it already claimed the retry): nothing changed
--   "<state>"   the job is not active: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'active' then
  return {state or 'missing'}
end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then
  return {'stale'}
end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'state', 'pending')
redis.call('ZREM', KEYS[3], ARGV[1])
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3] or '0')
redis.call('ZADD', KEYS[2], due, ARGV[1])
return {'retried'}
