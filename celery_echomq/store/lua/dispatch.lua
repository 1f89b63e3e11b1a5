-- dispatch: claim the right to publish a released parent, so it is published exactly once.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :processed (its children's values)
-- KEYS[3]  the queue's counters: 'dispatched' counts every dispatch handed out
-- ARGV[1]  parent id
-- ARGV[2]  ms after which an earlier dispatch that never started counts as lost;
--          '0' dispatches only a parent never dispatched before
-- ARGV[3]  the most values to return inline: a larger :processed is left for the host to
--          read in chunks (HSCAN), so that this script never blocks Redis for long
--
-- Reply: {} when there is nothing to publish (not released, already started or finished, or
--        dispatched and still within ARGV[2]); else the row marks the dispatch time and the
--        reply is {payload, "inline", id1, value1, id2, value2, ...} with every credited
--        child's value, or {payload, "scan"} when there are more than ARGV[3] of them.
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local processed_key = KEYS[2]
local counters_key = KEYS[3]
--- @include "gate"
--- @include "now_ms"
--- @include "hand_out"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
-- One read of the row: whether it waits to be dispatched, since when, and what to publish.
local row = redis.call('HMGET', parent_key, 'state', 'dispatched', 'payload')
if row[1] ~= 'pending' then
  return {}
end
local now = now_ms()
local last = row[2]
if last then
  local after = tonumber(ARGV[2])
  if after <= 0 or now - tonumber(last) < after then
    return {}
  end
end
return hand_out(parent_key, processed_key, counters_key, row[3], tonumber(ARGV[3]), now_text())
