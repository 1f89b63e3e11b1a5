-- retry_deadline: an operator retries a flow failed by its deadline, giving it a new one (on
-- the parent's slot). The parent goes back to awaiting_children with its new deadline armed;
-- the children its deadline cut, and those that failed under policy 'fail' since, become
-- pending again, as new attempts the host publishes. The counter is left as it is: a cut
-- child was never counted, nor was one failed under 'fail', and one that finished after the
-- deadline was counted then; each cut child run again leaves the row's 'cut_children'.
--
-- KEYS[1]    the parent row
-- KEYS[2]    the parent's :dependencies  }
-- KEYS[3]    the parent's :processed     } made persistent again: the failure had set them
-- KEYS[4]    the parent's :ignored       } to expire with the result TTL
-- KEYS[5]    the parent's :settled       }
-- KEYS[6]    the queue's pending set
-- KEYS[7]    the queue's failed set
-- KEYS[8]    the queue's counters (a parent held again; a release)
-- KEYS[9]    the queue's deadline index
-- KEYS[9+i]  child i's row, i = 1..N: the flow's children on this slot
-- ARGV[1]    parent id
-- ARGV[2]    'in' (ARGV[3] ms from now) or 'at' (ARGV[3] ms since the epoch): the new deadline
-- ARGV[3]    ms
-- ARGV[3+i]  child i's id
--
-- Reply: {status, at, id1, payload1, delta1, ...} the children made pending (the host
--        publishes their stored jobs; a nested flow's parent among them is dispatched)
--   "retried"    the parent awaits its children again, until ``at``
--   "released"   it awaits nothing (its counter is 0, or its quorum was met after the
--                deadline): it is pending, the host dispatches it
--   "<state>"    refused, nothing changed: the parent is not failed by its deadline
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local processed_key = KEYS[3]
local ignored_key = KEYS[4]
local settled_key = KEYS[5]
local pending_key = KEYS[6]
local failed_key = KEYS[7]
local counters_key = KEYS[8]
local deadlines_key = KEYS[9]
local children_at = 9 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "keys"
--- @include "expire"
--- @include "now_ms"
--- @include "release_parent"
--- @include "repend"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local id = ARGV[1]
local row = redis.call('HMGET', parent_key, 'state', 'failed_by', 'policy')
if row[1] ~= 'failed' or row[2] ~= 'deadline' then
  return {row[1] == 'failed' and 'failed' or (row[1] or 'missing')}
end
local now = now_ms()
local at = tonumber(ARGV[3])
if ARGV[2] == 'in' then
  at = now + at
end
local default = row[3] or 'fail'
local reply = {'retried', at}
for i = 1, #KEYS - 9 do
  local child, cid = KEYS[children_at + i], ARGV[3 + i]
  local c = redis.call('HMGET', child, 'state', 'parent', 'cut', 'parent_policy')
  local again = c[2] == id and ((c[1] == 'cancelled' and c[3] == 'deadline')
    or (c[1] == 'failed' and (c[4] or default) == 'fail'))
  if again then
    repend(child, cid, pending_key, failed_key, now, reply, 'cut', 'dispatched')
    -- A cut child runs again: cut no more. A flow whose deadline fired before cuts were
    -- counted ('cut_children' absent) has none to count back.
    if c[1] == 'cancelled' and tonumber(redis.call('HGET', parent_key, 'cut_children') or '0') > 0
        then
      redis.call('HINCRBY', parent_key, 'cut_children', -1)
    end
  end
end
redis.call('HSET', parent_key, 'state', 'awaiting_children')
redis.call('HDEL', parent_key, 'error', 'failed_by', 'deadline_fired', 'deadline_outstanding',
  'propagated')
redis.call('HINCRBY', counters_key, 'held', 1)
redis.call('ZREM', failed_key, id)
persist_keys({parent_key, deps_key, processed_key, ignored_key, settled_key})
redis.call('ZADD', deadlines_key, at, id)
-- Under a quorum whose K-th success came after the deadline (includes/quorum.lua keeps the
-- row's 'quorum' then), met already: released at once, as a counter of 0 is.
local need = tonumber(redis.call('HGET', parent_key, 'quorum') or '')
if need and redis.call('LLEN', quorum_of(parent_key)) >= need
    or tonumber(redis.call('GET', deps_key) or '0') <= 0 then
  release_parent(parent_key, pending_key, id, counters_key)
  reply[1] = 'released'
end
return reply
