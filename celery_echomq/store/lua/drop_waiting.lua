-- drop_waiting: delete the rows of a flow's children that still wait for a slot of its
-- window (waiting -> gone), on one queue's slot: what a forget (ops/forget.py) and the undo of
-- a refused start (send/start.py) delete of such children, counted out of the queue's
-- 'window_waiting' in the same step (includes/unwait.lua). A row that left 'waiting' since
-- the host read it (its window let it out, a cancel) is left to the caller's own delete: only
-- the transition that happens here is counted.
--
-- KEYS[1]    the queue's counters
-- KEYS[1+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone); '' for the undo of a
--            refused start, whose rows the host wrote itself (a chunk of another slot's children)
-- ARGV[1+i]  child i's id
--
-- Reply: {id1, id2, ...} the children whose rows were deleted here; a second run deletes none.
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
--- @include "gate"
--- @include "unwait"
--- @include "format"
local refused = (ARGV[1] ~= '' and gate_ids(1, 1)) or gate_ids(2, #ARGV)
  or newer_rows(KEYS, 2, #KEYS)
if refused then
  return refused
end
local reply = {}
for i = 2, #KEYS do
  local c = redis.call('HMGET', KEYS[i], 'state', 'parent', 'chain')
  if c[1] == 'waiting' and not c[3] and (ARGV[1] == '' or c[2] == ARGV[1]) then
    redis.call('DEL', KEYS[i])
    left_window(KEYS[1], c[1], c[3])
    reply[#reply + 1] = ARGV[i]
  end
end
return reply
