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
-- Reply: {n, c1, ..., cn, id1, id2, ...}: c1..cn the children of the flow to count as cut on
--        the parent's slot (none where the parent shares this one: counted here); id1, ...
--        the jobs cancelled now (the host revokes their messages), steps of a linked chain
--        before its last among them (the chain is one child)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local pending_key = KEYS[1]
local active_key = KEYS[2]
local counters_key = KEYS[3]
local parent_key = KEYS[4]
local children_at = 4 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "cancel_children"
--- @include "cut_here"
--- @include "format"
local refused = gate_ids(1, 1) or gate_ids(4, #ARGV) or newer_rows(KEYS, children_at, #KEYS)
if refused then
  return refused
end
local cancelled = {}
local cut = cancel_children(children_at + 1, 4, pending_key, active_key, counters_key,
  tonumber(ARGV[2]), cancelled, ARGV[3] == '1', ARGV[1])
local counted = {}
-- A parent of another slot is counted there.
if not counted_here(parent_key, counters_key, cut) then
  -- Every child of the parent this slot's rows say was cancelled, not only those cancelled
  -- now: credit_cut counts each once, so a count the host never made (it died after an
  -- earlier run) is made by the next run, on the rows' evidence.
  for i = children_at + 1, #KEYS do
    local c = redis.call('HMGET', KEYS[i], 'state', 'parent', 'next')
    if c[1] == 'cancelled' and c[2] == ARGV[1] and not c[3] then
      counted[#counted + 1] = ARGV[i - 1]
    end
  end
end
local reply = {#counted}
for _, list in ipairs({counted, cancelled}) do
  for _, cid in ipairs(list) do
    reply[#reply + 1] = cid
  end
end
return reply
