-- cancel_shared: stop a job shared by several flows (on_exists="join") once none of its
-- parents waits for it any more: the cancel of its last waiting parent (ops/cancel.py). A
-- cancel leaves such a job alone (includes/cancel_children.lua); the host then reads every
-- parent's state and calls this for a job none of them waits for. A parent joined since the
-- host read the edges refuses it: the edge count must be the one the host read.
--
-- KEYS[1]  the job's row
-- KEYS[2]  the job's :parents (the parents it was joined to after its first)
-- KEYS[3]  its queue's pending set
-- KEYS[4]  its queue's active set
-- KEYS[5]  its queue's counters (a job waiting for a slot of a flow's window: one fewer
--          'window_waiting', includes/unwait.lua)
-- ARGV[1]  the job's id
-- ARGV[2]  result TTL in seconds (the cancelled row and its edges expire with it)
-- ARGV[3]  the number of edges the host read (HLEN of KEYS[2])
--
-- Reply: {status}
--   "cancelled"  it was pending, waiting or running: now cancelled (the host revokes it)
--   "joined"     a parent was joined to it since the host read: nothing changed
--   "<state>"    finished (done, failed, cancelled) or gone: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local parents_key = KEYS[2]
local pending_key = KEYS[3]
local active_key = KEYS[4]
local counters_key = KEYS[5]
--- @include "gate"
--- @include "unwait"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({job_key}, 1)
if refused then
  return refused
end
local state, chain = unpack(redis.call('HMGET', job_key, 'state', 'chain'))
if state ~= 'pending' and state ~= 'waiting' and state ~= 'active' then
  return {state or 'missing'}
end
if redis.call('HLEN', parents_key) ~= tonumber(ARGV[3]) then
  return {'joined'}
end
redis.call('HSET', job_key, 'state', 'cancelled')
left_window(counters_key, state, chain)
redis.call('ZREM', pending_key, ARGV[1])
redis.call('ZREM', active_key, ARGV[1])
redis.call('EXPIRE', job_key, ARGV[2])
redis.call('EXPIRE', parents_key, ARGV[2])
return {'cancelled'}
