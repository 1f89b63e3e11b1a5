-- deadline_cut: the part of a deadline (deadline.lua) that the host runs after it, a chunk of
-- children per call: those of the parent's slot beyond the chunk deadline.lua cut, and those
-- routed to another queue than their parent's, on their slot. Each one that has not started
-- is cut (cut_pending). deadline.lua has already failed or released the parent, so a child
-- that finishes later is credited to a parent that no longer waits.
--
-- KEYS[1]    this queue's pending set
-- KEYS[2]    this queue's counters (a child cut while waiting for a slot of its flow's
--            window: one fewer 'window_waiting'; 'children_cut', where the parent shares
--            the slot)
-- KEYS[3]    the parent's row where it shares this slot (each child cut is counted on it:
--            'cut_children'), else the queue's placeholder (the host counts them on the
--            parent's slot after: credit_cut)
-- KEYS[3+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone)
-- ARGV[2]    result TTL in seconds
-- ARGV[3]    the error the cut rows keep ("FlowDeadlineExceeded: ...")
-- ARGV[3+i]  child i's id
--
-- Only a pending row changes, so a second run changes nothing.
-- Reply: {n, c1, ..., cn, id1, id2, ...}: c1..cn the children to count as cut on the parent's
--        slot (none where the parent shares this one: counted here); id1, ... the children
--        cut now (the host revokes their messages).
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local pending_key = KEYS[1]
local counters_key = KEYS[2]
local parent_key = KEYS[3]
local children_at = 3 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "cut_pending"
--- @include "cut_here"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows(KEYS, children_at, #KEYS)
if refused then
  return refused
end
local ttl = tonumber(ARGV[2])
local cut = {}
for i = 1, #KEYS - children_at do
  if cut_pending(KEYS[children_at + i], ARGV[3 + i], ARGV[1], pending_key, ttl, ARGV[3],
      counters_key) then
    cut[#cut + 1] = ARGV[3 + i]
  end
end
local counted = {}
-- A parent of another slot is counted there.
if not counted_here(parent_key, counters_key, cut) then
  -- Every child of the parent its deadline cut here, not only now (see cancel_elsewhere):
  -- a chain is cut by its one pending step.
  for i = children_at + 1, #KEYS do
    local c = redis.call('HMGET', KEYS[i], 'state', 'parent', 'cut')
    if c[1] == 'cancelled' and c[2] == ARGV[1] and c[3] == 'deadline' then
      counted[#counted + 1] = ARGV[i]
    end
  end
end
local reply = {#counted}
for _, list in ipairs({counted, cut}) do
  for _, cid in ipairs(list) do
    reply[#reply + 1] = cid
  end
end
return reply
