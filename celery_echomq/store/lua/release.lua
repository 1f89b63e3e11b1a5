-- release: an operator runs a held parent now, with the values its children returned so
-- far, as policy 'continue' does. Later completions are still recorded in :processed and
-- counted, but never release the parent again: settle_child releases only a parent that
-- still awaits its children, and this one no longer does.
--
-- KEYS[1]    the parent row ('cut_children' counts the children revoked here)
-- KEYS[2]    the parent queue's pending set
-- KEYS[3]    the parent queue's active set
-- KEYS[4]    the parent queue's counters (a release; a parent fewer held, and each held
--            nested flow revoked; 'children_cut')
-- KEYS[4+i]  child i's row, i = 1..N (children on this slot; only read with ARGV[3] == '1')
-- ARGV[1]    parent id
-- ARGV[2]    result TTL in seconds (a revoked child's row expires with it)
-- ARGV[3]    '1' to revoke the children not started: each pending or held child on this
--            slot becomes cancelled (no later claim runs it, no completion counts it), while
--            running ones finish and are recorded (children of other slots: cancel_elsewhere);
--            '0' to let them all run
-- ARGV[3+i]  child i's id
--
-- Reply: {status, id1, id2, ...}
--   "released"   awaiting_children -> pending (the host dispatches the parent); the ids are
--                the children cancelled (the host revokes their messages)
--   "<state>"    refused, nothing changed: the parent is not held (pending, active, done,
--                failed, cancelled, or "missing" for no row)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
local counters_key = KEYS[4]
local children_at = 4 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "now_ms"
--- @include "release_parent"
--- @include "cancel_children"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local state = redis.call('HGET', parent_key, 'state')
if state ~= 'awaiting_children' then
  return {state or 'missing'}
end
release_parent(parent_key, pending_key, ARGV[1], counters_key)
redis.call('HSET', parent_key, 'released_by', 'operator')
local reply = {'released'}
if ARGV[3] == '1' then
  local cut = cancel_children(children_at + 1, 4, pending_key, active_key, counters_key,
    tonumber(ARGV[2]), reply, false, ARGV[1])
  if #cut > 0 then
    -- Counted as cut: the flow ended without them (see cancel.lua).
    redis.call('HINCRBY', parent_key, 'cut_children', #cut)
    redis.call('HINCRBY', counters_key, 'children_cut', #cut)
  end
end
return reply
