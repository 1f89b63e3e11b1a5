-- join_edge: a job that exists becomes the child of one more parent (apply_async's
-- on_exists="join", send/join.py): on the job's own slot, the edge to the new parent is
-- recorded in its '<row>:parents' and the job's state read in the same atomic step, so the
-- host knows whether the new parent is to be credited at once (the job finished) or waits.
--
-- KEYS[1]  the job's row                 emq:{q}:JOBc
-- KEYS[2]  the job's edges to parents it was joined to (parent id -> 'policy|queue')
--          emq:{q}:JOBc:parents
-- ARGV[1]  the job's id
-- ARGV[2]  the new parent's id
-- ARGV[3]  the new parent's queue
-- ARGV[4]  the job's parent_policy under the new parent ('' for that flow's default)
--
-- Reply: {state, error, parent}: the job's state ('' when its row is gone: no edge is then
-- written), its 'error' field and its own (first) parent's id; the edge is written once
-- (HSETNX: a join repeated by its host changes nothing) and expires with the job's row
-- when the row expires; the row gains 'joined' = '1'.
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local parents_key = KEYS[2]
--- @include "gate"
--- @include "format"
local refused = gate_ids(1, 2) or newer_rows({job_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', job_key, 'state', 'error', 'parent')
if not row[1] then
  return {'', '', ''}
end
redis.call('HSETNX', parents_key, ARGV[2], ARGV[4] .. '|' .. ARGV[3])
-- The row says it has edges ('joined'): its completion reads that with its holder, in the
-- HMGET it makes anyway, and looks at '<row>:parents' only then.
redis.call('HSET', job_key, 'joined', '1')
local ttl = redis.call('PTTL', job_key)
if ttl > 0 then
  redis.call('PEXPIRE', parents_key, ttl)
end
return {row[1], row[2] or '', row[3] or ''}
