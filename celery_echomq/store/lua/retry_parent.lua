-- retry_parent: an operator's retry runs again a flow parent whose own body failed (its
-- children had all settled, it was released and ran): a chain's step, or the parent of a
-- nested flow. It becomes pending again, as a released parent not yet dispatched, and the
-- host dispatches it with its children's values (dispatch.lua), which are still there.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies  }
-- KEYS[3]  the parent's :processed     } made persistent again: the failure had set them
-- KEYS[4]  the parent's :ignored       } to expire with the result TTL
-- KEYS[5]  the queue's pending set
-- KEYS[6]  the queue's failed set
-- ARGV[1]  the parent's id
-- ARGV[2]  the id of the flow it is a child of ('' for a top-level flow): the row's own
--          'parent' must be that one
--
-- Reply: {status}
--   "retried"   failed by its own body -> pending (the host dispatches it)
--   "<state>"   refused, nothing changed: not failed, or failed by a child ("child": retry
--               that flow's children instead), or another flow's ("forged")
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local processed_key = KEYS[3]
local ignored_key = KEYS[4]
local pending_key = KEYS[5]
local failed_key = KEYS[6]
--- @include "gate"
--- @include "expire"
--- @include "now_ms"
--- @include "chain_rest"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', parent_key, 'state', 'failed_child', 'parent', 'next')
if row[1] ~= 'failed' then
  return {row[1] or 'missing'}
end
if (row[3] or '') ~= ARGV[2] then
  return {'forged'}
end
if row[2] then
  return {'child'}
end
redis.call('HSET', parent_key, 'state', 'pending')
redis.call('HDEL', parent_key, 'error', 'token', 'dispatched', 'propagated', 'suspect')
redis.call('ZREM', failed_key, ARGV[1])
redis.call('ZADD', pending_key, now_ms(), ARGV[1])
persist_keys({parent_key, deps_key, processed_key, ignored_key})
if row[4] then
  persist_steps_after(parent_key, ARGV[1], row[4])  -- a chain's step: the steps waiting behind it
end
return {'retried'}
