-- credit: the fan-in on the parent's slot for a child that lives on another slot. The
-- child's own complete/fail already ran on its slot and staged the outcome in its queue's
-- outbox; this applies it to the parent exactly once per child id (:settled), whatever
-- recovery or a redelivery repeats.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies
-- KEYS[3]  the parent's :processed
-- KEYS[4]  the parent's :ignored
-- KEYS[5]  the parent's :settled (child id -> outcome: what makes the credit idempotent)
-- KEYS[6]  the parent queue's pending set
-- KEYS[7]  the parent queue's failed set
-- KEYS[8]  the parent queue's counters (releases, parents held, failures per policy)
-- ARGV[1]  parent id
-- ARGV[2]  child id
-- ARGV[3]  outcome: "done" or "failed"
-- ARGV[4]  the child's value (done) or "ExcType: message" (failed)
-- ARGV[5]  the child's parent_policy ('' for the flow's default)
-- ARGV[6]  result TTL in seconds
-- ARGV[7]  the options, a msgpack map (an option not given is not in it):
--   quorum  "K/N", the parent is released by the K-th success of its N children
--           (flow(..., quorum=K), includes/quorum.lua); not given: by the last of them
--
-- Reply: {status, policy}
--   "released"       the parent is now pending (the host dispatches it)
--   "credited"       counted; the parent still waits, or no longer waits
--   "parent_failed"  policy fail: the parent is failed (the host records FAILURE for it)
--   "duplicate"      this child was credited before: nothing changed
--   "missing"        no parent row (the flow was forgotten or has expired): nothing changed,
--                    so a child staged just before its flow was forgotten leaves no
--                    :settled, :processed or :dependencies behind (keys without a TTL)
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
--- @include "gate"
--- @include "settle_child"
--- @include "format"
local refused = gate_ids(1, 2) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
if redis.call('EXISTS', parent_key) == 0 then
  return {'missing', ''}
end
if redis.call('HSETNX', settled_key, ARGV[2], ARGV[3]) == 0 then
  return {'duplicate', ''}
end
local parent = {id = ARGV[1], row = parent_key, deps = deps_key, processed = processed_key,
  ignored = ignored_key, settled = settled_key, pending = pending_key, failed = failed_key,
  counters = counters_key, quorum = cmsgpack.unpack(ARGV[#ARGV]).quorum}
return settle_child(parent, ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]))
