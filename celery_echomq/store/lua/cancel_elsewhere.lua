-- cancel_elsewhere: the part of a cancel (or of release --revoke) that lives on a child's
-- slot: children of one parent that sit on another slot than their parent's, or children
-- still outstanding once their parent was released (under continue, or by an operator).
--
-- KEYS[1]    this queue's pending set
-- KEYS[2]    this queue's active set
-- KEYS[3]    this queue's counters (a held nested flow cancelled counts one parent fewer held)
-- KEYS[3+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone)
-- ARGV[2]    result TTL in seconds (a cancelled row expires with it)
-- ARGV[3]    '1' to cancel running (active) children too; '0' for only those not started
-- ARGV[3+i]  child i's id
--
-- Reply: {id1, id2, ...} the children cancelled (the host revokes their messages)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
--- @include "gate"
--- @include "cancel_children"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows(KEYS, 4, #KEYS)
if refused then
  return refused
end
local reply = {}
cancel_children(4, 4, KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[2]), reply, ARGV[3] == '1',
  ARGV[1])
return reply
