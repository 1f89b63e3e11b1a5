-- not_holder(row, token[, field]): nil when the job is active and ``token`` is its current
-- token (the caller's delivery holds it); else the reply that says why nothing may change:
-- {state} for a job that is not active ('missing' for no row), {'stale'} for a superseded
-- delivery. ``field``: one more field of the row, read in the same HMGET and returned second
-- when the caller holds the job (nil, value).
local function not_holder(row, token, field)
  local held
  if field then
    held = redis.call('HMGET', row, 'state', 'token', field)
  else
    held = redis.call('HMGET', row, 'state', 'token')
  end
  if held[1] ~= 'active' then
    return {held[1] or 'missing'}
  end
  if held[2] ~= token then
    return {'stale'}
  end
  return nil, held[3]
end
