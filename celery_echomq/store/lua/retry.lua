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
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
--- @include "gate"
--- @include "holder"
--- @include "now_ms"
local refused = gate_ids(1, 1) or not_holder(job_key, ARGV[2])
if refused then
  return refused
end
redis.call('HSET', job_key, 'state', 'pending')
redis.call('ZREM', active_key, ARGV[1])
local due = now_ms() + tonumber(ARGV[3])
redis.call('ZADD', pending_key, due, ARGV[1])
return {'retried'}
