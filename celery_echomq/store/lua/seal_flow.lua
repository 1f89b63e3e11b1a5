-- seal_flow: the last step of the chunked path: every child was added, so remove the extra
-- unit open_flow put on the counter. If the children already all completed, release now.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies
-- KEYS[3]  the parent queue's pending set
-- KEYS[4]  the parent queue's open set
-- KEYS[5]  the parent queue's counters (a release counts there)
-- ARGV[1]  parent id
--
-- Reply: {status}
--   "released"  sealed, and nothing was outstanding: the parent is pending (host dispatches)
--   "sealed"    sealed; children outstanding
--   "noop"      not open (sealed before, or failed by recovery): nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local pending_key = KEYS[3]
local open_key = KEYS[4]
local counters_key = KEYS[5]
--- @include "gate"
--- @include "release_parent"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
-- Leaving the open set is what makes the seal happen once.
if redis.call('ZREM', open_key, ARGV[1]) == 0 then
  return {'noop'}
end
local left = redis.call('DECR', deps_key)
if release_if_last(parent_key, pending_key, ARGV[1], left, counters_key) then
  return {'released'}
end
return {'sealed'}
