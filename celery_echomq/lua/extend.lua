-- extend: a live worker pushes back the deadlines of the flow jobs it is running, so recovery
-- never takes a long task for a lost one (as BullMQ's workers renew their job locks).
--
-- KEYS[1]   the queue's active set (score: the deadline after which recovery treats a job as lost)
-- ARGV[1]   lease in ms: each deadline becomes at least server time + lease
-- ARGV[2..] the ids of the jobs this worker is running on that queue
--
-- Reply: the number of deadlines moved. A job that is not in the active set (finished, failed,
--        retried, or not claimed yet) is left out: this script never makes a job active, and
--        never shortens a deadline.
-- Errors: "EMQKIND ..." a non-JOB id (checked for every id before any write).
for i = 2, #ARGV do
  if string.sub(ARGV[i], 1, 3) ~= 'JOB' then
    return redis.error_reply('EMQKIND job id must be JOB-namespaced')
  end
end
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local moved = 0
for i = 2, #ARGV do
  local current = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if current and tonumber(current) < deadline then
    redis.call('ZADD', KEYS[1], deadline, ARGV[i])
    moved = moved + 1
  end
end
return moved
