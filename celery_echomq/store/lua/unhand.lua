-- unhand: a chain's step that the completion of the step before handed out active
-- (complete.lua, ARGV[13]) and that no delivery took before its lease lapsed goes back to
-- pending, as it would have been made without the handing out: then recovery's evidence
-- for a pending job (the claim marks, a broker that reports the queue empty) tells a backlog
-- from a lost message, and its message, when it comes, is claimed as any delivery.
--
-- KEYS[1]  the step's row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set
-- ARGV[1]  the step's id
--
-- Reply: {status}
--   "pending"  it was active with no token and its lease had lapsed: now pending, scored when
--              it was handed out (its 'started'), its 'attempts' back to 0
--   "fresh"    its lease has not lapsed (a worker renewed it, or it was handed out lately)
--   "noop"     anything else (taken by a delivery: it has a token; finished; gone)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
--- @include "gate"
--- @include "now_ms"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({job_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', job_key, 'state', 'token', 'started')
if row[1] ~= 'active' or row[2] then
  return {'noop'}
end
local lease = redis.call('ZSCORE', active_key, ARGV[1])
local now = now_ms()
if lease and tonumber(lease) > now then
  return {'fresh'}
end
redis.call('ZREM', active_key, ARGV[1])
redis.call('ZADD', pending_key, tonumber(row[3] or now) or now, ARGV[1])
redis.call('HSET', job_key, 'state', 'pending', 'attempts', '0')
return {'pending'}
