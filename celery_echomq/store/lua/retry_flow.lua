-- retry_flow: an operator retries a flow that failed under policy 'fail' (on the parent's
-- slot). The parent goes back to awaiting_children and the failed children named here become
-- pending again, as new attempts the host publishes; the counter is left as it is, because
-- a child that failed under 'fail' was never counted (settle_child returns before the DECR),
-- so the counter already says how many children are neither done nor otherwise settled.
--
-- KEYS[1]    the parent row
-- KEYS[2]    the parent's :dependencies  }
-- KEYS[3]    the parent's :processed     } made persistent again: the failure had set them
-- KEYS[4]    the parent's :ignored       } to expire with the result TTL
-- KEYS[5]    the parent's :settled       }
-- KEYS[6]    the parent queue's pending set
-- KEYS[7]    the parent queue's failed set
-- KEYS[8]    the parent queue's counters (a parent held again; a release)
-- KEYS[8+i]  child i's row, i = 1..N: a failed child on this slot to run again
-- ARGV[1]    parent id
-- ARGV[2]    N
-- ARGV[2+i]  child i's id, i = 1..N
-- ARGV[3+N..] ids of other children retried elsewhere (a child on another slot, reset by
--            retry_children.lua; a nested flow, reset by its own retry_flow): their entry
--            in :settled is removed, so that their new outcome is credited once more
--
-- A child is made pending only when it is failed and its policy (its own parent_policy, else
-- the flow's default) is 'fail' or 'fail_at_end' (which, unlike 'fail', counted the child
-- as resolved: it is counted back): a child counted under ignore/remove/continue, or one already
-- retried, is left alone, so a second run of the same retry changes nothing.
-- Every child retried, here or elsewhere, leaves the parent's record of failed children
-- (its 'failed:<id>' field, counted in 'failed_children'; see settle_child).
--
-- Reply: {status, id1, payload1, delta1, id2, payload2, delta2, ...} the children made
--        pending (the host publishes their stored jobs: the payload or, nil payload, the
--        delta against the template on the parent's row; see codec.py)
--   "retried"    the parent awaits its children again
--   "released"   the parent awaits nothing (its counter is 0: every outstanding child has
--                settled meanwhile): it is now pending and the host dispatches it
--   "<state>"    refused, nothing changed: the parent is not failed by a child
--                ("failed" for a parent whose own body failed or that was abandoned),
--                or it is held and none of the named children could be retried
--                ("awaiting_children"), or it is pending, active, done, cancelled, missing
-- Under a quorum (the row's 'quorum', includes/quorum.lua) each child retried counts as
-- failed no more, and the parent is released when K children have succeeded.
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
local children_at = 8 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "keys"
--- @include "expire"
--- @include "now_ms"
--- @include "release_parent"
--- @include "repend"
--- @include "join"
--- @include "format"

-- unrecord(cid): the child leaves the parent's record of failed children. Returns whether it
-- had failed under fail_at_end: such a child was counted as resolved (settle_child), so it is
-- outstanding again, and one such failure fewer.
local function unrecord(cid)
  local late = redis.call('HGET', failures_of(parent_key), cid) == 'late'
  if redis.call('HDEL', parent_key, 'failed:' .. cid) == 1 then
    redis.call('HINCRBY', parent_key, 'failed_children', -1)
    redis.call('HDEL', failures_of(parent_key), cid) -- see settle_child
  end
  return late
end

-- count_back(need): a child credited as failed is outstanding again: under a quorum one
-- failure fewer, under fail_at_end one such failure fewer (a quorum counts its own).
local function count_back(need)
  redis.call('HINCRBY', parent_key, need and 'quorum_failed' or 'late_failed', -1)
  redis.call('HINCRBY', parent_key, 'credited_failed', -1)
  redis.call('INCR', deps_key)
end
-- ARGV[2] is a count, not an id: gate the ids on either side of it.
local refused = gate_ids(1, 1) or gate_ids(3, #ARGV) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', parent_key, 'state', 'failed_child', 'policy', 'quorum')
-- A flow released by a quorum (includes/quorum.lua): each child retried is one failure fewer,
-- and outstanding again; the parent is released by its K-th success, not by its counter.
local need = tonumber(row[4] or '')
local state = row[1]
if state == 'failed' and not row[2] then
  return {'failed'}
end
if state ~= 'failed' and state ~= 'awaiting_children' then
  return {state or 'missing'}
end
local n = tonumber(ARGV[2])
local default = row[3] or 'fail'
local now = now_ms()
local reply = {'retried'}
for i = 1, n do
  local child = KEYS[children_at + i]
  local cid = ARGV[2 + i]
  local c = redis.call('HMGET', child, 'state', 'parent_policy', 'parent')
  if c[1] == 'failed' and c[3] ~= ARGV[1] then
    -- A job joined to this parent (on_exists="join"): the policy of its edge applies.
    local joined, policy = joined_to(child, ARGV[1])
    c[3] = joined and ARGV[1] or c[3]
    c[2] = joined and (policy ~= '' and policy or nil) or c[2]
  end
  local policy = c[2] or default
  if c[1] == 'failed' and (policy == 'fail' or policy == 'fail_at_end') and c[3] == ARGV[1] then
    redis.call('HDEL', settled_key, cid)
    local late = unrecord(cid)
    repend(child, cid, pending_key, failed_key, now, reply)
    if need or late then
      count_back(need)
    end
  end
end
local others = #ARGV - 2 - n
for i = 3 + n, #ARGV do
  -- A child of another slot credited as failed under the quorum or under fail_at_end:
  -- outstanding again.
  local credited = redis.call('HDEL', settled_key, ARGV[i]) == 1
  local late = unrecord(ARGV[i])
  if credited and (need or late) then
    count_back(need)
  end
end
if state == 'awaiting_children' and #reply == 1 and others == 0 then
  return {'awaiting_children'}
end
if state == 'failed' then
  redis.call('HSET', parent_key, 'state', 'awaiting_children')
  redis.call('HINCRBY', counters_key, 'held', 1)
  redis.call('HDEL', parent_key, 'error', 'failed_child', 'propagated', 'late_child')
  redis.call('ZREM', failed_key, ARGV[1])
  persist_keys({parent_key, deps_key, processed_key, ignored_key, settled_key})
end
if need and redis.call('LLEN', quorum_of(parent_key)) >= need
    or not need and tonumber(redis.call('GET', deps_key) or '0') <= 0 then
  release_parent(parent_key, pending_key, ARGV[1], counters_key)
  reply[1] = 'released'
end
return reply
