-- grow_flow: add children to a flow while its parent is held, on the parent's slot, in one
-- step: the new ids appended to the parent's payload (the order its values reach it in), the
-- counter raised by every new child, the children of this slot written claimable, and the
-- children of other slots staged (their payloads kept here) until add_children has written
-- them on their own slots. A staged child cannot complete before its row exists, so the
-- raised counter holds the parent until it does; recovery writes what a crash left staged.
--
-- KEYS[1]     the parent row
-- KEYS[2]     the parent's :dependencies
-- KEYS[3]     the parent queue's pending set
-- KEYS[4]     the parent's :adding (staged child id -> payload; "<id>:policy" -> its policy)
-- KEYS[5]     the parent queue's adding set (parents with staged children; score: when)
-- KEYS[6]     the parent queue's counters (its children waiting in windows:
--             'window_waiting')
-- KEYS[7]     the parent's window on this slot (includes/window.lua): where the children that
--             find no room wait, with options.max_active
-- KEYS[7+i]   child i's row on this slot, i = 1..k
-- ARGV[1]     parent id
-- ARGV[2]     SHA1 of the parent payload the host read (the payload is rewritten only if
--             it is still that one: two concurrent adds never lose each other's ids)
-- ARGV[3]     the new parent payload (the old one with the new ids appended to its children)
-- ARGV[4]     k, children written on this slot
-- ARGV[5]     r, children staged for other slots
-- ARGV[3+3i]  (i = 1..k+r) child i's id; ARGV[4+3i] its payload; ARGV[5+3i] its
--             parent_policy ('' to use the flow's default)
-- ARGV[6+3(k+r)] the options, a msgpack map (an option not given is not in it):
--   max_active  the flow's window (includes/window.lua; not given: none): as many of the
--               children of this slot as it has room for are written pending, in order, the
--               others waiting at the end of its window (KEYS[7])
--
-- Reply: {status, n}
--   {"added", counter, started}   written (and staged); the counter after the add; how many
--                        of the children of this slot are pending (the first ones: the
--                        host publishes those; with no window, all of them)
--   {"stale", 0}         the payload changed since the host read it: nothing written, read again
--   {<state>, 0}         the parent no longer waits for children ("pending", "active", "done",
--                        "failed", "cancelled", "missing"): nothing written
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQEXISTS <id>" a row of this slot
--   already exists.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local pending_key = KEYS[3]
local adding_key = KEYS[4]
local adding_set_key = KEYS[5]
local counters_key = KEYS[6]
local window_key = KEYS[7]
local children_at = 7 -- child i's row on this slot is KEYS[children_at + i]
--- @include "gate"
--- @include "keys"
--- @include "now_ms"
--- @include "child_row"
--- @include "window"
--- @include "format"
local k = tonumber(ARGV[4])
local r = tonumber(ARGV[5])
local refused = gate_ids(1, 1) or gate_ids(6, 3 + 3 * (k + r), 3) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', parent_key, 'state', 'payload')
if row[1] ~= 'awaiting_children' then
  return {row[1] or 'missing', 0}
end
if redis.sha1hex(row[2]) ~= ARGV[2] then
  return {'stale', 0}
end
for i = 1, k do
  if redis.call('EXISTS', KEYS[children_at + i]) == 1 then
    return redis.error_reply('EMQEXISTS ' .. ARGV[3 + 3 * i])
  end
end
local now = now_ms()
local size = tonumber(cmsgpack.unpack(ARGV[#ARGV]).max_active)
local window = window_key
local room = size and window_room(size, deps_key, window, k) or k
local waiting = {}
for i = 1, k do
  local child = KEYS[children_at + i]
  if i > room then
    write_waiting_row(child, ARGV[1], ARGV[4 + 3 * i], WAIT_PAYLOAD)
    waiting[#waiting + 1] = ARGV[3 + 3 * i]
  else
    write_child_row(child, ARGV[1], ARGV[4 + 3 * i], false, size ~= nil)
    redis.call('ZADD', pending_key, now, ARGV[3 + 3 * i])
  end
  if ARGV[5 + 3 * i] ~= '' then
    redis.call('HSET', child, 'parent_policy', ARGV[5 + 3 * i])
  end
end
if #waiting > 0 then
  window_push(window, waiting, size, counters_key)
end
for i = k + 1, k + r do
  redis.call('HSET', adding_key, ARGV[3 + 3 * i], ARGV[4 + 3 * i])
  if ARGV[5 + 3 * i] ~= '' then
    redis.call('HSET', adding_key, ARGV[3 + 3 * i] .. ':policy', ARGV[5 + 3 * i])
  end
end
if r > 0 then
  redis.call('ZADD', adding_set_key, now, ARGV[1])
end
-- The parent's format is its flow's newest (includes/format.lua): raised to this release's.
redis.call('HSET', parent_key, 'payload', ARGV[3], 'format', STORE_FORMAT_TEXT)
-- The new children at the end of the parent's index by position, the list '<its row>:children'
-- (see enqueue_flow; a flow written before the index existed has none: its pages read the
-- payload, and it gets none now, which would list only the new ones).
local index_key = children_of(parent_key)
if redis.call('EXISTS', index_key) == 1 then
  local index = {}
  for i = 1, k + r do
    index[#index + 1] = ARGV[3 + 3 * i]
    if #index >= 500 or i == k + r then
      redis.call('RPUSH', index_key, unpack(index))
      index = {}
    end
  end
end
return {'added', redis.call('INCRBY', deps_key, k + r), math.min(room, k)}
