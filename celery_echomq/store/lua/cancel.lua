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
--- @include "gate"
--- @include "expire"
--- @include "cancel_children"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows(KEYS, 1)
if refused then
  return refused
end
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'awaiting_children' and state ~= 'pending' then
  return {state or 'missing'}
end
local ttl = tonumber(ARGV[2])
local reply = {'cancelled', state}
redis.call('HSET', KEYS[1], 'state', 'cancelled')
redis.call('ZREM', KEYS[5], ARGV[1])
if state == 'awaiting_children' then
  redis.call('HINCRBY', KEYS[7], 'held', -1)
end
expire_keys(ttl, {KEYS[1], KEYS[2], KEYS[3], KEYS[4]})
local cut = cancel_children(8, 3, KEYS[5], KEYS[6], KEYS[7], ttl, reply, true, ARGV[1])
-- Each child cancelled is one the flow ended without: counted as cut, never as outstanding
-- (reads.counts_of takes it out of the counter, which only a settled child counts down).
if #cut > 0 then
  redis.call('HINCRBY', KEYS[1], 'cut_children', #cut)
  redis.call('HINCRBY', KEYS[7], 'children_cut', #cut)
end
return reply
