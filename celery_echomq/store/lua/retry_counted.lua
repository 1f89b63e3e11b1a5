-- retry_counted: an operator retries one child that failed under ignore, remove or continue,
-- or under fail_at_end while its parent still waits (on the parent's slot, the child's too).
-- Such a child was counted as resolved when it failed: this takes that back, so that its new
-- attempt counts toward the parent again.
-- The parent is not held again: a parent still awaiting its children waits for this one
-- too; one already released (under continue, or by its other children) keeps its course,
-- and the child's new value is recorded in its :processed without releasing it again.
--
-- KEYS[1]  the child's row
-- KEYS[2]  the parent row
-- KEYS[3]  the parent's :dependencies
-- KEYS[4]  the parent's :ignored
-- KEYS[5]  the queue's pending set
-- KEYS[6]  the queue's failed set
-- ARGV[1]  the child's id
-- ARGV[2]  the parent's id (a child whose row names another parent is left alone)
--
-- Reply: {status, payload, delta}
--   "retried"   the child is pending again (the host publishes its stored job: the payload
--               or, nil payload, the delta against the template on the parent's row)
--   "<state>"   the child is not failed under ignore, remove or continue ('fail': retry the
--               flow; 'forged': it is not this parent's child): nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local parent_key = KEYS[2]
local deps_key = KEYS[3]
local ignored_key = KEYS[4]
local pending_key = KEYS[5]
local failed_key = KEYS[6]
--- @include "gate"
--- @include "keys"
--- @include "now_ms"
--- @include "chain_rest"
--- @include "format"
local refused = gate_ids(1, 2) or newer_rows({job_key, parent_key}, 1, 2)
if refused then
  return refused
end
local c = redis.call('HMGET', job_key, 'state', 'parent_policy', 'parent', 'payload', 'delta',
  'input', 'next')
if c[3] ~= ARGV[2] then
  return {c[1] and 'forged' or 'missing'}
end
if c[1] ~= 'failed' then
  return {c[1]}
end
local policy = c[2] or redis.call('HGET', parent_key, 'policy') or 'fail'
if policy == 'fail' or policy == 'fail_at_end'
    and redis.call('HGET', parent_key, 'state') == 'failed' then
  -- Under fail_at_end once the parent has failed: as under fail, the flow's retry.
  return {'fail'}
end
redis.call('HSET', job_key, 'state', 'pending')
redis.call('HDEL', job_key, 'error', 'suspect', 'token')
redis.call('PERSIST', job_key)
if c[7] then
  persist_steps_after(job_key, ARGV[1], c[7])  -- a chain's step: the steps waiting behind it
end
redis.call('ZREM', failed_key, ARGV[1])
redis.call('ZADD', pending_key, now_ms(), ARGV[1])
-- Uncounted: one more outstanding, one resolved failure fewer, its error no longer kept.
redis.call('INCR', deps_key)
redis.call('HINCRBY', parent_key, 'credited_failed', -1)
-- Its failure taken back where it was counted: under a quorum (the row's 'quorum', written at
-- a failure; never under continue, which released the parent) one more child that can succeed,
-- else under fail_at_end one failure fewer for the parent to give.
if policy ~= 'continue' and redis.call('HEXISTS', parent_key, 'quorum') == 1 then
  redis.call('HINCRBY', parent_key, 'quorum_failed', -1)
elseif policy == 'fail_at_end' then
  redis.call('HINCRBY', parent_key, 'late_failed', -1)
end
redis.call('HDEL', ignored_key, ARGV[1])
-- And it leaves the parent's record of failed children (see settle_child).
if redis.call('HDEL', parent_key, 'failed:' .. ARGV[1]) == 1 then
  redis.call('HINCRBY', parent_key, 'failed_children', -1)
  redis.call('HDEL', failures_of(parent_key), ARGV[1]) -- see settle_child
end
return {'retried', c[4], c[5], c[6]}
