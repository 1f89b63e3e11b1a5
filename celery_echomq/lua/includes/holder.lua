-- not_holder(row, token): nil when the job is active and ``token`` is its current token (the
-- caller's delivery holds it); else the reply that says why nothing may change: {state} for a
-- job that is not active ('missing' for no row), {'stale'} for a superseded delivery.
local function not_holder(row, token)
  local held = redis.call('HMGET', row, 'state', 'token')
  if held[1] ~= 'active' then
    return {held[1] or 'missing'}
  end
  if held[2] ~= token then
    return {'stale'}
  end
  return nil
end
