-- cancel: stop a whole flow. The parent becomes cancelled (it will never be released or run)
-- and every child not yet finished becomes cancelled too, so no later claim takes it.
--
-- KEYS[1]    the parent row ('cut_children' counts the children cancelled here)
-- KEYS[2]    the parent's :dependencies  }
-- KEYS[3]    the parent's :processed     } expire with the parent: the flow is finished
-- KEYS[4]    the parent's :ignored       }
-- KEYS[5]    the queue's pending set
-- KEYS[6]    the queue's active set
-- KEYS[7]    the queue's counters: one parent fewer held when it was held; 'children_cut'
-- KEYS[7+i]  child i's row, i = 1..N (children on this slot; those of other slots are
--            cancelled there by cancel_elsewhere, once this has cancelled the parent)
-- ARGV[1]    parent id
-- ARGV[2]    result TTL in seconds
-- ARGV[2+i]  child i's id
--
-- Reply: {status, was, id1, id2, ...}
--   "cancelled"  the parent was held (was = "awaiting_children") or released but not started
--                (was = "pending": the host revokes its message too); the ids are the
--                children that were still outstanding (the host revokes their messages)
--   "<state>"    the parent is active, done, failed or already cancelled: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local processed_key = KEYS[3]
local ignored_key = KEYS[4]
local pending_key = KEYS[5]
local active_key = KEYS[6]
local counters_key = KEYS[7]
local children_at = 7 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "expire"
--- @include "cancel_children"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local state = redis.call('HGET', parent_key, 'state')
if state ~= 'awaiting_children' and state ~= 'pending' then
  return {state or 'missing'}
end
local ttl = tonumber(ARGV[2])
local reply = {'cancelled', state}
redis.call('HSET', parent_key, 'state', 'cancelled')
redis.call('ZREM', pending_key, ARGV[1])
if state == 'awaiting_children' then
  redis.call('HINCRBY', counters_key, 'held', -1)
end
expire_keys(ttl, {parent_key, deps_key, processed_key, ignored_key})
local cut = cancel_children(children_at + 1, 3, pending_key, active_key, counters_key, ttl, reply,
  true, ARGV[1])
-- Each child cancelled is one the flow ended without: counted as cut, never as outstanding
-- (reads.counts_of takes it out of the counter, which only a settled child counts down).
if #cut > 0 then
  redis.call('HINCRBY', parent_key, 'cut_children', #cut)
  redis.call('HINCRBY', counters_key, 'children_cut', #cut)
end
return reply
