-- dispatch: claim the right to publish a released parent, so it is published exactly once.
--
-- KEYS[1]  the parent row
-- KEYS[2]  the parent's :processed (its children's values)
-- ARGV[1]  parent id
-- ARGV[2]  ms after which an earlier dispatch that never started counts as lost;
--          '0' dispatches only a parent never dispatched before
--
-- Reply: {} when there is nothing to publish (not released, already started or finished, or
--        dispatched and still within ARGV[2]); else {payload, id1, value1, id2, value2, ...}
--        with every credited child's value, and the row marks the dispatch time.
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then
  return {}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = redis.call('HGET', KEYS[1], 'dispatched')
if last then
  local after = tonumber(ARGV[2])
  if after <= 0 or now - tonumber(last) < after then
    return {}
  end
end
redis.call('HSET', KEYS[1], 'dispatched', now)
local reply = {redis.call('HGET', KEYS[1], 'payload')}
local values = redis.call('HGETALL', KEYS[2])
for i = 1, #values do
  reply[#reply + 1] = values[i]
end
return reply
