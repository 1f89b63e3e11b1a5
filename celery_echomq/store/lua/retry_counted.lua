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
--- @include "gate"
--- @include "now_ms"
--- @include "chain_rest"
--- @include "format"
local refused = gate_ids(1, 2) or newer_rows(KEYS, 1, 2)
if refused then
  return refused
end
local c = redis.call('HMGET', KEYS[1], 'state', 'parent_policy', 'parent', 'payload', 'delta',
  'input', 'next')
if c[3] ~= ARGV[2] then
  return {c[1] and 'forged' or 'missing'}
end
if c[1] ~= 'failed' then
  return {c[1]}
end
local policy = c[2] or redis.call('HGET', KEYS[2], 'policy') or 'fail'
if policy == 'fail' or policy == 'fail_at_end'
    and redis.call('HGET', KEYS[2], 'state') == 'failed' then
  -- Under fail_at_end once the parent has failed: as under fail, the flow's retry.
  return {'fail'}
end
redis.call('HSET', KEYS[1], 'state', 'pending')
redis.call('HDEL', KEYS[1], 'error', 'suspect', 'token')
redis.call('PERSIST', KEYS[1])
if c[7] then
  persist_steps_after(KEYS[1], ARGV[1], c[7])  -- a chain's step: the steps waiting behind it
end
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('ZADD', KEYS[5], now_ms(), ARGV[1])
-- Uncounted: one more outstanding, one resolved failure fewer, its error no longer kept.
redis.call('INCR', KEYS[3])
redis.call('HINCRBY', KEYS[2], 'credited_failed', -1)
-- Its failure taken back where it was counted: under a quorum (the row's 'quorum', written at
-- a failure; never under continue, which released the parent) one more child that can succeed,
-- else under fail_at_end one failure fewer for the parent to give.
if policy ~= 'continue' and redis.call('HEXISTS', KEYS[2], 'quorum') == 1 then
  redis.call('HINCRBY', KEYS[2], 'quorum_failed', -1)
elseif policy == 'fail_at_end' then
  redis.call('HINCRBY', KEYS[2], 'late_failed', -1)
end
redis.call('HDEL', KEYS[4], ARGV[1])
-- And it leaves the parent's record of failed children (see settle_child).
if redis.call('HDEL', KEYS[2], 'failed:' .. ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'failed_children', -1)
  redis.call('HDEL', KEYS[2] .. ':failures', ARGV[1]) -- see settle_child
end
return {'retried', c[4], c[5], c[6]}
