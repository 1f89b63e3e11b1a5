-- drop: the worker that ran a job saw its pool process die (SIGKILL, OOM): the holder is known
-- dead, so its lease ends now rather than when it would have lapsed.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's active set
-- KEYS[3]  the queue's pending set
-- KEYS[4]  the queue's counters (hash)
-- ARGV[1]  job id
-- ARGV[2]  the dead holder's token prefix ("host|pid|"): a claim made since by anyone else
--          is left alone
--
-- Reply:
--   {"lapsed"}             the lease ends now: the broker's redelivery (acks late) claims it
--                          at once; without one, recovery's next pass settles it
--   {"requeued", payload, delta, parent}  a duplicate delivery was skipped while the dead
--                          holder looked alive, so no message is left for it: the job is
--                          pending again and the host re-publishes its stored job (the
--                          payload, or with a nil payload the delta against the template on
--                          the parent's row; see codec.py)
--   {"noop"}               not active under that holder (finished, retried, claimed anew)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local active_key = KEYS[2]
local pending_key = KEYS[3]
local counters_key = KEYS[4]
--- @include "gate"
--- @include "now_ms"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({job_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', job_key, 'state', 'token', 'skipped')
if row[1] ~= 'active' or string.sub(row[2] or '', 1, #ARGV[2]) ~= ARGV[2] then
  return {'noop'}
end
local now = now_ms()
if row[3] then
  redis.call('HDEL', job_key, 'skipped')
  redis.call('HSET', job_key, 'state', 'pending')
  redis.call('HINCRBY', job_key, 'requeued', 1)
  redis.call('HINCRBY', counters_key, 'republished', 1)
  redis.call('ZREM', active_key, ARGV[1])
  redis.call('ZADD', pending_key, now, ARGV[1])
  local stored = redis.call('HMGET', job_key, 'payload', 'delta', 'parent', 'input')
  return {'requeued', stored[1], stored[2], stored[3], stored[4]}
end
redis.call('ZADD', active_key, now, ARGV[1])
return {'lapsed'}
