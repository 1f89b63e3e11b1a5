-- deadline_cut: the part of a deadline (deadline.lua) that the host runs after it, a chunk of
-- children per call: those of the parent's slot beyond the chunk deadline.lua cut, and those
-- routed to another queue than their parent's, on their slot. Each one that has not started
-- is cut (cut_pending). deadline.lua has already failed or released the parent, so a child
-- that finishes later is credited to a parent that no longer waits.
--
-- KEYS[1]    this queue's pending set
-- KEYS[2]    this queue's counters (a child cut while waiting for a slot of its flow's
--            window: one fewer 'window_waiting')
-- KEYS[2+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone)
-- ARGV[2]    result TTL in seconds
-- ARGV[3]    the error the cut rows keep ("FlowDeadlineExceeded: ...")
-- ARGV[3+i]  child i's id
--
-- Only a pending row changes, so a second run changes nothing.
-- Reply: {id1, id2, ...} the children cut (the host revokes their messages).
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
--- @include "gate"
--- @include "cut_pending"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows(KEYS, 3, #KEYS)
if refused then
  return refused
end
local ttl = tonumber(ARGV[2])
local reply = {}
for i = 1, #KEYS - 2 do
  if cut_pending(KEYS[2 + i], ARGV[3 + i], ARGV[1], KEYS[1], ttl, ARGV[3], KEYS[2]) then
    reply[#reply + 1] = ARGV[3 + i]
  end
end
return reply
