-- requeue: recovery takes back a job whose message was lost, so the host can re-publish it.
-- Two cases (DESIGN section 5):
--   pending  a child pending past the stall timeout and never claimed (a lost message, or a
--            producer that died between enqueue_flow and its publishes);
--   active   a job active past its deadline whose result backend holds no outcome (its worker
--            died mid-task and the message is gone).
-- The job is re-scored in the same step that hands out its payload: a second pass (another
-- worker, the CLI) sees it fresh and does not re-publish it again before another stall timeout.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set
-- ARGV[1]  job id
-- ARGV[2]  ms after which the job counts as lost: the stall timeout (plus, for a child sent
--          with a countdown or an eta, that delay)
-- ARGV[3]  the state the caller found: 'pending' or 'active'
-- ARGV[4]  for 'active', the token the caller found (the claim whose worker is presumed lost)
--
-- Reply:
--   {"requeued", payload}  re-scored: pending -> score now; active -> deadline now + stall
--                 timeout (the job stays active: its next delivery's claim takes it over with a
--                 new token). The host re-publishes payload (a flow parent with its children's
--                 values, which it reads from :processed in chunks, as dispatch does).
--   {"fresh"}     not stalled (claimed, retried or requeued since the caller looked): nothing changed
--   {"stale"}     active under another token than the caller found: nothing changed
--   {"missing"}   no row (expired or deleted): its stray entries in both sets are removed
--   {"<state>"}   the job is no longer in the state the caller found: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
if string.sub(ARGV[1], 1, 3) ~= 'JOB' then
  return redis.error_reply('EMQKIND job id must be JOB-namespaced')
end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {'missing'}
end
if state ~= ARGV[3] or (state ~= 'pending' and state ~= 'active') then
  return {state}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stall = tonumber(ARGV[2])
if state == 'pending' then
  local since = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if since and now - tonumber(since) < stall then
    return {'fresh'}
  end
  redis.call('ZADD', KEYS[2], now, ARGV[1])
else
  if redis.call('HGET', KEYS[1], 'token') ~= ARGV[4] then
    return {'stale'}
  end
  local deadline = redis.call('ZSCORE', KEYS[3], ARGV[1])
  if deadline and tonumber(deadline) > now then
    return {'fresh'}
  end
  redis.call('ZADD', KEYS[3], now + stall, ARGV[1])
end
redis.call('HINCRBY', KEYS[1], 'requeued', 1)
return {'requeued', redis.call('HGET', KEYS[1], 'payload')}
