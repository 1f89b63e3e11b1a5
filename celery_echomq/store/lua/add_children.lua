-- add_children: the middle step of the chunked path: write one chunk of a flow's children
-- that live on one queue's slot, claimable, each carrying its parent and its policy.
--
-- KEYS[1]     the queue's pending set
-- KEYS[2]     the window of the parent's children on this slot (includes/window.lua): where
--             a child of kind 'D' or 'P' is pushed
-- KEYS[3]     the queue's counters (its children waiting in windows: 'window_waiting')
-- KEYS[3+i]   child i's row, i = 1..k
-- ARGV[1]     parent id
-- ARGV[2]     the parent's queue when it differs from this one (the child's completion is
--             then credited on the parent's slot by credit.lua); '' on the parent's slot
-- ARGV[3]     k, the number of children in this call
-- ARGV[1+3i]  child i's id
-- ARGV[2+3i]  child i's stored job: its payload, or its delta (see options.kinds)
-- ARGV[3+3i]  child i's parent_policy ('' to use the flow's default, read on the parent's slot)
-- ARGV[4+3k]  the options, a msgpack map (an option not given is not in it):
--   kinds       one character per child, 'd' where ARGV[2+3i] is a delta against the template
--               open_flow kept on the parent's row (only on the parent's own slot; the row
--               keeps it as 'delta', small enough to stay a listpack), 'p' where it is a whole
--               payload (not given: every child's is a payload); 's', 'w', 'l' for the first,
--               a middle and the last step of a linked chain, in order, never split across
--               two calls (includes/chain_step.lua)
--               'D', 'P': a child waiting for a slot of its flow's window, as a delta or a
--               payload (includes/window.lua): written 'waiting', its id pushed to KEYS[2];
--               'e', 'q': a child of a flow with a window that goes out at once, as a delta
--               or a payload (written as 'd' and 'p' are, marked 'windowed': it holds a slot)
--   max_active  with a 'D' or 'P' kind: the window's size
--
-- Reply: the number of rows written. A row that already exists for this same parent is
-- left as it is (a repeated add writes nothing twice).
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQEXISTS <id>" a row of another flow.
local pending_key = KEYS[1]
local window_key = KEYS[2]
local counters_key = KEYS[3]
local children_at = 3 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "now_ms"
--- @include "child_row"
--- @include "chain_step"
--- @include "window"
local k = tonumber(ARGV[3])
local refused = gate_ids(1, 1) or gate_ids(4, 1 + 3 * k, 3)
if refused then
  return refused
end
-- One variadic EXISTS per slice (Lua's unpack has a stack limit); only a slice with a hit
-- (a chunk sent again, or another flow's row) is looked at row by row.
local SLICE = 500
local fresh = {}
for first = 1, k, SLICE do
  local last = math.min(first + SLICE - 1, k)
  if redis.call('EXISTS', unpack(KEYS, first + 3, last + 3)) == 0 then
    for i = first, last do
      fresh[#fresh + 1] = i
    end
  else
    for i = first, last do
      local owner = redis.call('HGET', KEYS[children_at + i], 'parent')
      if owner == false then
        if redis.call('EXISTS', KEYS[children_at + i]) == 1 then
          return redis.error_reply('EMQEXISTS ' .. ARGV[1 + 3 * i])
        end
        fresh[#fresh + 1] = i
      elseif owner ~= ARGV[1] then
        return redis.error_reply('EMQEXISTS ' .. ARGV[1 + 3 * i])
      end
    end
  end
end
local now = now_ms()
local options = cmsgpack.unpack(ARGV[#ARGV])
local kinds = options.kinds or ''
local members = {}
local heads, head, head_at = {}, '', 0
local function id_at(i)
  return ARGV[1 + 3 * i]
end
for i = 1, k do
  if string.byte(kinds, i) == STEP_FIRST then
    head, head_at = id_at(i), i
  end
  heads[i] = {head, head_at}
end
-- The children waiting for a slot of the flow's window, in order (a repeated chunk's rows
-- exist: none of them is pushed twice).
local waiting = {}
for n, i in ipairs(fresh) do
  local row = KEYS[children_at + i]
  local kind = string.byte(kinds, i)
  local pending = true
  if is_step(kind) then
    pending = write_step_row(row, ARGV[1], ARGV[2 + 3 * i], kind, heads[i][1], ARGV[4 + 3 * i],
      kind == STEP_LAST and step_ids(heads[i][2], i, id_at) or nil)
  elseif is_waiting(kind) then
    write_waiting_row(row, ARGV[1], ARGV[2 + 3 * i], kind)
    waiting[#waiting + 1] = ARGV[1 + 3 * i]
    pending = false
  else
    write_child_row(row, ARGV[1], ARGV[2 + 3 * i], is_delta_out(kind),
      is_windowed_out(kind))
  end
  if ARGV[2] ~= '' then
    redis.call('HSET', row, 'pq', ARGV[2])
  end
  if ARGV[3 + 3 * i] ~= '' then
    redis.call('HSET', row, 'parent_policy', ARGV[3 + 3 * i])
  end
  if pending then
    members[#members + 1] = now
    members[#members + 1] = ARGV[1 + 3 * i]
  end
  if #members >= 2 * SLICE or (n == #fresh and #members > 0) then
    redis.call('ZADD', pending_key, unpack(members))
    members = {}
  end
end
if #waiting > 0 then
  window_push(window_key, waiting, tonumber(options.max_active), counters_key)
end
return #fresh
