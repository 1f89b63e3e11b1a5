-- hand_over: a job's body replaced itself (Celery's Task.replace): the replacement runs under
-- the same task id and stores the job's outcome in the result backend. The job stays active,
-- held by the replacement, until recovery reads that outcome and completes or fails it with
-- this token, as a chord's counter waits for the replacement's result.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's active set
-- ARGV[1]  job id
-- ARGV[2]  the token of the delivery that was replaced
--
-- Reply: {status}
--   "handed_over"  marked 'replaced', and due at once for recovery's next look at the backend;
--                  a claim of any other delivery of the job answers "busy" from now on
--   "stale"        another delivery holds the job: nothing changed
--   "<state>"      the job is not active: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local active_key = KEYS[2]
--- @include "gate"
--- @include "holder"
--- @include "now_ms"
local refused = gate_ids(1, 1) or not_holder(job_key, ARGV[2])
if refused then
  return refused
end
redis.call('HSET', job_key, 'replaced', '1')
redis.call('ZADD', active_key, now_ms(), ARGV[1])
return {'handed_over'}
