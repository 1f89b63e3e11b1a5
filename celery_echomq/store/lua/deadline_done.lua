-- deadline_done: the host finished what follows a fired deadline (the parent's FAILURE
-- recorded, or its dispatch; the cut children revoked): the index entry goes.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the queue's deadline index
-- ARGV[1]  parent id
-- ARGV[2]  the 'deadline_fired' time the host acted on: an entry armed again since (a retry
--          with a new deadline clears that field) is left alone
--
-- Reply: 1 when the entry was removed, else 0.
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deadlines_key = KEYS[2]
--- @include "gate"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
if redis.call('HGET', parent_key, 'deadline_fired') ~= ARGV[2] then
  return 0
end
return redis.call('ZREM', deadlines_key, ARGV[1])
