-- deadline_arm: give a flow the deadline its fan-in keeps, just before the flow (or this level
-- of it) is enqueued: its id goes into the queue's deadline index, scored with the time the
-- deadline passes on the server's clock. Arming first is what makes a producer crash safe:
-- an entry whose flow never landed is dropped when it comes due (deadline.lua: 'missing'),
-- while a flow that landed always has its entry.
--
-- KEYS[1]  the parent row: absent, or the pending placeholder a nested flow's outer flow
--          wrote (it names ARGV[4] as its parent and has not been claimed)
-- KEYS[2]  the queue's deadline index (zset: parent id -> when its deadline passes, ms)
-- ARGV[1]  parent id
-- ARGV[2]  'in': ARGV[3] is ms from now; 'at': ARGV[3] is ms since the epoch
-- ARGV[3]  ms
-- ARGV[4]  the outer flow's parent id when this flow is nested, else ''
--
-- Reply: {"armed", at}: the entry is written (written again by a resent call: idempotent,
--        a relative deadline then counts from the later call); at is its score
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQEXISTS <id>" the row exists (and
--        is not the outer flow's placeholder).
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deadlines_key = KEYS[2]
--- @include "gate"
--- @include "now_ms"
--- @include "placeholder"
local refused = gate_ids(1, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', parent_key, 'state', 'parent', 'attempts', 'format')
refused = newer_format(row[4], parent_key)
if refused then
  return refused
end
if row[1] and not is_placeholder(row, ARGV[4]) then
  return redis.error_reply('EMQEXISTS ' .. ARGV[1])
end
local at = tonumber(ARGV[3])
if ARGV[2] == 'in' then
  at = now_ms() + at
end
redis.call('ZADD', deadlines_key, at, ARGV[1])
return {'armed', at}
