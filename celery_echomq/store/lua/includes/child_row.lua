-- write_child_row(row, parent_id, stored, is_delta, windowed): a child's row, claimable: state
-- pending, no attempt yet, its parent's id, and its stored job, either whole ('payload') or,
-- when is_delta, only what differs from its flow's template on the parent's row ('delta': a
-- short value keeps the row in Redis's compact hash encoding); with ``windowed``, the mark of
-- a child that holds a slot of its flow's window ('windowed', includes/window.lua), which the
-- script that finishes it reads to free the slot: a child of a flow without a window is
-- finished without a look at one. Every script that makes a child pending for the first time
-- writes it here, so readers find one layout; with this release's format (includes/format.lua).
--- @include "format"
local function write_child_row(row, parent_id, stored, is_delta, windowed)
  -- Without the mark, 'parent' again stands in for it (the same field, the same value).
  redis.call('HSET', row, 'state', 'pending', 'attempts', '0',
    is_delta and 'delta' or 'payload', stored, 'parent', parent_id,
    windowed and 'windowed' or 'parent', windowed and '1' or parent_id, 'format', STORE_FORMAT_TEXT)
end
