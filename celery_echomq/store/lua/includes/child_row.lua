-- write_child_row(row, parent_id, stored, is_delta): a child's row, claimable: state pending,
-- no attempt yet, its parent's id, and its stored job, either whole ('payload') or, when
-- is_delta, only what differs from its flow's template on the parent's row ('delta': a short
-- value keeps the row in Redis's compact hash encoding). Every script that makes a child
-- pending for the first time writes it here, so readers find one layout.
local function write_child_row(row, parent_id, stored, is_delta)
  redis.call('HSET', row, 'state', 'pending', 'attempts', '0',
    is_delta and 'delta' or 'payload', stored, 'parent', parent_id)
end
