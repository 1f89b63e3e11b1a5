-- credit_cut: the count on the parent's slot of children cut on another slot (cancelled, or
-- cut by a deadline or a quorum, by cancel_elsewhere or deadline_cut there): each is counted
-- once as cut ('cut_children' on the parent's row), whatever repeats the call, through the
-- parent's :settled (the child id -> 'cut'), as credit.lua counts a settled one.
--
-- KEYS[1]    the parent row
-- KEYS[2]    the parent's :settled (child id -> outcome: what makes the count idempotent)
-- KEYS[3]    the parent queue's counters ('children_cut')
-- ARGV[1]    parent id
-- ARGV[1+i]  child i's id, i = 1..N (each one its slot's script cut)
--
-- Reply: {status, n}
--   "credited"  n of the children were counted now (the others had been before)
--   "missing"   no parent row (the flow was forgotten or has expired): nothing written
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local settled_key = KEYS[2]
local counters_key = KEYS[3]
--- @include "gate"
--- @include "format"
local refused = gate_ids(1, #ARGV) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
if redis.call('EXISTS', parent_key) == 0 then
  return {'missing', 0}
end
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('HSETNX', settled_key, ARGV[i], 'cut')
end
if n > 0 then
  redis.call('HINCRBY', parent_key, 'cut_children', n)
  redis.call('HINCRBY', counters_key, 'children_cut', n)
end
-- :settled lives as long as the row: a finished flow's keys expire together.
local ttl = redis.call('PTTL', parent_key)
if ttl > 0 then
  redis.call('PEXPIRE', settled_key, ttl)
end
return {'credited', n}
