-- write_step_row(row, parent_id, stored, kind, head, next_id): one step of a linked chain (a
-- chain of tasks among a flow's children), written with its siblings in one script so that
-- the chain is whole before any step can run. ``kind`` is the byte of its letter: 's' the
-- first step, pending like any child; 'w' a middle step and 'l' the last, 'waiting': in no
-- state set, so nothing can claim them, until the completion of the step before makes them
-- pending (complete.lua). Every step names the flow's parent (its failure is the chain's,
-- under the chain's policy), the chain's first step (``chain``: where show and cancel start
-- walking) and, but the last, the step after it (``next``). Only the last step is counted by
-- the parent; its row also lists every step's id, in order (``steps``: what show and cancel
-- read in one page). Returns true for a step to put in the pending set.
--- @include "format"
local STEP_FIRST, STEP_WAITING, STEP_LAST = 115, 119, 108
local function is_step(kind)
  return kind == STEP_FIRST or kind == STEP_WAITING or kind == STEP_LAST
end

local function write_step_row(row, parent_id, stored, kind, head, next_id, steps)
  local state = kind == STEP_FIRST and 'pending' or 'waiting'
  -- One HSET a row: its link is 'next', or on the last step 'steps'.
  local link, linked = 'next', next_id
  if kind == STEP_LAST then
    link, linked = 'steps', steps
  end
  redis.call('HSET', row, 'state', state, 'attempts', '0', 'payload', stored,
    'parent', parent_id, 'chain', head, link, linked, 'format', STORE_FORMAT_TEXT)
  return kind == STEP_FIRST
end

-- step_ids(first, last, at): the ids of a chain's steps, ``at(i)`` the id of row i, joined by
-- spaces: the last step's ``steps``.
local function step_ids(first, last, at)
  local ids = {}
  for i = first, last do
    ids[#ids + 1] = at(i)
  end
  return table.concat(ids, ' ')
end
