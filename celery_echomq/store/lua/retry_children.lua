-- retry_children: the part of an operator's retry (retry_flow.lua) that lives on a child's
-- slot, for children routed to another queue than their parent's. retry_flow has already
-- put the parent back to awaiting_children and removed these children from its :settled, so
-- their new outcomes are credited once each (credit.lua); this makes the failed rows pending
-- again, as new attempts the host publishes.
--
-- KEYS[1]    this queue's pending set
-- KEYS[2]    this queue's failed set
-- KEYS[2+i]  child i's row, i = 1..N
-- ARGV[1]    the parent id (a row whose 'parent' differs is left alone, unless the job was
--            joined to that parent: on_exists="join", includes/join.lua)
-- ARGV[1+i]  child i's id
--
-- Only a failed row is changed, so a second run of the same retry changes nothing.
--
-- Reply: {id1, payload1, delta1, id2, payload2, delta2, ...} the children made pending (maybe
--        none): each one's stored job, its payload or (nil payload) its delta against the
--        template on the parent's row (see codec.py)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local pending_key = KEYS[1]
local failed_key = KEYS[2]
local children_at = 2 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "now_ms"
--- @include "repend"
--- @include "join"
--- @include "format"
local refused = gate_ids(1, #ARGV) or newer_rows(KEYS, children_at + 1, #KEYS)
if refused then
  return refused
end
local now = now_ms()
local reply = {}
for i = 1, #KEYS - 2 do
  local child = KEYS[children_at + i]
  local cid = ARGV[1 + i]
  local c = redis.call('HMGET', child, 'state', 'parent')
  if c[1] == 'failed' and (c[2] == ARGV[1] or joined_to(child, ARGV[1])) then
    repend(child, cid, pending_key, failed_key, now, reply)
  end
end
return reply
