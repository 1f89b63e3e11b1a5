-- not_holder(row, token[, field[, parent[, also[, more]]]]): nil when the job is active and
-- ``token`` is its current token (the caller's delivery holds it); else the reply that says why
-- nothing may change: {state} for a job that is not active ('missing' for no row), {'stale'}
-- for a superseded delivery. ``field``: one more field of the row, read in the same HMGET and
-- returned second when the caller holds the job (nil, value); ``also`` another, returned
-- third; ``more`` another, returned fourth. ``parent``: the parent id the caller names ('' for
-- none), compared with the row's own 'parent' in the same HMGET: a mismatch is {'forged'}
-- (the row decides, not a message). A row of a newer format than this release's is the
-- EMQFORMAT error reply, whoever holds it (includes/format.lua).
--- @include "format"
local function not_holder(row, token, field, parent, also, more)
  -- 'state' again stands in for a field the caller does not ask for.
  local held = redis.call('HMGET', row, 'state', 'token', parent and 'parent' or 'state',
    field or 'state', also or 'state', more or 'state', 'format')
  local refused = newer_format(held[7], row)
  if refused then
    return refused
  end
  if held[1] ~= 'active' then
    return {held[1] or 'missing'}
  end
  if held[2] ~= token then
    return {'stale'}
  end
  if parent and (held[3] or '') ~= parent then
    return {'forged'}
  end
  return nil, field and held[4] or nil, also and held[5] or nil, more and held[6] or nil
end
