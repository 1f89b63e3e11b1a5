-- hand_out(row, processed, counters, payload, inline_max, now): give one caller the right to
-- publish a released parent: its row marks the dispatch time (so recovery takes a later loss
-- of its message for a lost message, never for a parent nobody published), the queue counts
-- the dispatch (at ``now``, the server's ms as includes/now_ms.lua's now_text gives it: a
-- string, which Redis stores as it is), and the reply is what to publish: {payload, 'inline', id1, value1, ...} with
-- every credited child's value, or {payload, 'scan'} when there are more than inline_max of
-- them (the host reads those in chunks, so that no script blocks Redis for long).
local function hand_out(row, processed, counters, payload, inline_max, now)
  redis.call('HSET', row, 'dispatched', now)
  redis.call('HINCRBY', counters, 'dispatched', '1')
  if redis.call('HLEN', processed) > inline_max then
    return {payload, 'scan'}
  end
  local reply = {payload, 'inline'}
  local values = redis.call('HGETALL', processed)
  for i = 1, #values do
    reply[#reply + 1] = values[i]
  end
  return reply
end
