-- open_flow: the first step of the chunked path (children on other slots, or very many):
-- hold the parent with its counter at N + 1. The extra unit keeps the parent held however
-- fast the children complete, until seal_flow removes it after every child was added.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies
-- KEYS[3]  the parent queue's open set (flows not sealed yet; score: open time in ms, so
--          recovery can fail a flow whose producer died before sealing it)
-- KEYS[4]  the parent queue's pending set (a nested parent's placeholder leaves it here)
-- KEYS[5]  the parent queue's recent-flow index
-- KEYS[6]  the parent queue's counters (one parent more held)
-- ARGV[1]  parent id
-- ARGV[2]  parent payload
-- ARGV[3]  N, the number of children that add_children will write
-- ARGV[4]  the flow's default parent_policy
-- ARGV[5]  the outer flow's parent id when this flow is nested ('' when not)
-- ARGV[6]  how long, in ms, a flow stays in the recent index (the result TTL)
-- ARGV[7]  the most flows the recent index keeps
-- ARGV[8]  the options, a msgpack map (an option not given is not in it):
--   template  the template that add_children's deltas on this slot are stored against, kept
--             on the parent's row (not given: none)
--
-- Reply: N + 1 (the counter).
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQEXISTS <id>" the row exists
--         (other than a nested parent's placeholder written by its outer flow).
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local open_key = KEYS[3]
local pending_key = KEYS[4]
local recent_key = KEYS[5]
local counters_key = KEYS[6]
--- @include "gate"
--- @include "now_ms"
--- @include "placeholder"
--- @include "recent"
local refused = gate_ids(1, 1)
if refused then
  return refused
end
if redis.call('EXISTS', deps_key) > 0 then
  return redis.error_reply('EMQEXISTS ' .. ARGV[1])
end
local placeholder = redis.call('HMGET', parent_key, 'state', 'parent', 'attempts', 'format')
refused = newer_format(placeholder[4], parent_key)
if refused then
  return refused
end
if placeholder[1] then
  if not is_placeholder(placeholder, ARGV[5]) then
    return redis.error_reply('EMQEXISTS ' .. ARGV[1])
  end
  redis.call('ZREM', pending_key, ARGV[1])
end
local now = now_ms()
local n = tonumber(ARGV[3])
redis.call('HSET', parent_key, 'state', 'awaiting_children', 'attempts', '0', 'payload', ARGV[2],
  'policy', ARGV[4], 'format', STORE_FORMAT_TEXT)
local template = cmsgpack.unpack(ARGV[#ARGV]).template
if template then
  redis.call('HSET', parent_key, 'template', template)
end
redis.call('SET', deps_key, n + 1)
redis.call('ZADD', open_key, now, ARGV[1])
redis.call('HINCRBY', counters_key, 'held', 1)
index_recent(recent_key, ARGV[1], tonumber(ARGV[6]), tonumber(ARGV[7]))
return n + 1
