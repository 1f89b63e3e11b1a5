-- counted_here(parent, counters, cut): children cut on this slot (cancelled, or by a
-- deadline), ``cut`` their ids, counted on their parent's row ('cut_children') and their
-- queue's counters ('children_cut') when the parent shares this slot: returns true. A parent
-- of another slot is passed as the placeholder, which never exists: nothing is counted here
-- (credit_cut counts them there) and it returns false. cancel_elsewhere and deadline_cut
-- share it.
local function counted_here(parent, counters, cut)
  if redis.call('EXISTS', parent) == 0 then
    return false
  end
  if #cut > 0 then
    redis.call('HINCRBY', parent, 'cut_children', #cut)
    redis.call('HINCRBY', counters, 'children_cut', #cut)
  end
  return true
end
