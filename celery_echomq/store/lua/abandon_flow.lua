-- abandon_flow: recovery fails a flow of the chunked path whose producer stopped before it
-- wrote every child (the flow is still open past the stall timeout and children are missing).
-- Without this the extra unit open_flow put on the counter would hold the parent forever.
-- A flow whose children were all written is sealed instead (seal_flow), not abandoned.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :dependencies  }
-- KEYS[3]  the parent's :processed     } expire with the parent: the flow is finished
-- KEYS[4]  the parent's :ignored       }
-- KEYS[5]  the parent's :settled       }
-- KEYS[6]  the parent queue's open set (score: open time in ms)
-- KEYS[7]  the parent queue's failed set
-- KEYS[8]  the parent queue's counters: one parent fewer held
-- ARGV[1]  parent id
-- ARGV[2]  the stall timeout in ms: a flow opened less long ago is left to its producer
-- ARGV[3]  result TTL in seconds
-- ARGV[4]  the error recorded on the row
--
-- Reply: {status}
--   "abandoned"  open -> failed (row field 'abandoned' = 1); the host records FAILURE for it
--   "fresh"      opened less than a stall timeout ago: nothing changed
--   "noop"       not open (sealed, or abandoned before): nothing changed
--   "<state>"    open but no longer held (e.g. cancelled): only taken out of the open set
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local processed_key = KEYS[3]
local ignored_key = KEYS[4]
local settled_key = KEYS[5]
local open_key = KEYS[6]
local failed_key = KEYS[7]
local counters_key = KEYS[8]
--- @include "gate"
--- @include "expire"
--- @include "now_ms"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local opened = redis.call('ZSCORE', open_key, ARGV[1])
if not opened then
  return {'noop'}
end
local now = now_ms()
if now - tonumber(opened) < tonumber(ARGV[2]) then
  return {'fresh'}
end
-- Leaving the open set is what makes seal_flow a no-op from now on.
redis.call('ZREM', open_key, ARGV[1])
local state = redis.call('HGET', parent_key, 'state')
if state ~= 'awaiting_children' then
  return {state or 'missing'}
end
local ttl = tonumber(ARGV[3])
redis.call('HSET', parent_key, 'state', 'failed', 'abandoned', '1', 'error', ARGV[4])
redis.call('ZADD', failed_key, now, ARGV[1])
redis.call('HINCRBY', counters_key, 'held', -1)
expire_keys(ttl, {parent_key, deps_key, processed_key, ignored_key, settled_key})
return {'abandoned'}
