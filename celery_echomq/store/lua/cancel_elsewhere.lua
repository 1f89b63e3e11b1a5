-- cancel_elsewhere: the part of a cancel (or of release --revoke) that lives on a child's
-- slot: children of one parent that sit on another slot than their parent's, or children
-- still outstanding once their parent was released (under continue, or by an operator).
--
-- KEYS[1]    this queue's pending set
-- KEYS[2]    this queue's active set
-- KEYS[3]    this queue's counters (a held nested flow cancelled counts one parent fewer held;
--            'children_cut', where the parent shares the slot)
-- KEYS[4]    the parent's row where it shares this slot (each child cancelled is counted on it
--            as cut: 'cut_children'), else the queue's placeholder (the host counts them on
--            the parent's slot after: credit_cut)
-- KEYS[4+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone)
-- ARGV[2]    result TTL in seconds (a cancelled row expires with it)
-- ARGV[3]    '1' to cancel running (active) children too; '0' for only those not started
-- ARGV[3+i]  child i's id
--
-- Reply: {n, id1, id2, ...} the jobs cancelled (the host revokes their messages): the first n
--        are children of the flow, counted as cut; the rest steps of a linked chain before
--        its last (the chain is one child)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
--- @include "gate"
--- @include "cancel_children"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows(KEYS, 4, #KEYS)
if refused then
  return refused
end
local cancelled = {}
local cut = cancel_children(5, 4, KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[2]), cancelled,
  ARGV[3] == '1', ARGV[1])
-- The placeholder never exists: a parent of another slot is counted there.
if #cut > 0 and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HINCRBY', KEYS[4], 'cut_children', #cut)
  redis.call('HINCRBY', KEYS[3], 'children_cut', #cut)
end
local reply, counted = {#cut}, {}
for _, cid in ipairs(cut) do
  reply[#reply + 1] = cid
  counted[cid] = true
end
for _, cid in ipairs(cancelled) do
  if not counted[cid] then
    reply[#reply + 1] = cid
  end
end
return reply
