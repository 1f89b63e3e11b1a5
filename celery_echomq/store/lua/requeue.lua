-- requeue: recovery takes back a job whose message is gone, so the host can re-publish it.
-- The host calls it only on evidence (see recovery/); this script re-checks, atomically, what
-- that evidence rests on, and bounds how often one job is re-published.
--   pending  a job pending past the stall timeout that no live worker holds, where the queue
--            has since delivered later jobs or is empty (a lost message, or a producer that
--            died between enqueueing and publishing);
--   active   a job whose holder's lease lapsed and whose result backend holds no outcome (its
--            worker died mid-task and its message is gone).
-- The job is re-scored in the same step that hands out its payload: a second pass (another
-- worker, the CLI) sees it fresh and does not re-publish it again within the backoff.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set
-- KEYS[4]  the queue's reserved set (jobs a live worker holds without running them yet)
-- KEYS[5]  the queue's counters (hash): 'republished' counts every requeue
-- ARGV[1]  job id
-- ARGV[2]  ms after which the job counts as stalled: the stall timeout (plus, for a child sent
--          with a countdown or an eta, that delay); doubled for each earlier re-publish of the
--          job, up to 16 times
-- ARGV[3]  the state the caller found: 'pending' or 'active'
-- ARGV[4]  for 'active', the token the caller found (the claim whose holder is presumed lost)
--
-- Reply:
--   {"requeued", payload, delta, parent}  pending, scored now (an active job leaves the active set: the
--                 lapsed holder's token can no longer complete it, and the re-published
--                 delivery claims it as a first one). The host re-publishes its stored job: the
--                 payload, or (nil payload) the delta against the template on the parent's
--                 row (a child its flow wrote in one step; see codec.py) (a flow
--                 parent with its children's values, which it reads from :processed in
--                 chunks, as dispatch does).
--   {"fresh"}     not stalled (claimed, retried, renewed or requeued since the caller looked)
--   {"held"}      a live worker holds it (its reserved lease has not lapsed): nothing changed
--   {"stale"}     active under another token than the caller found: nothing changed
--   {"missing"}   no row (expired or deleted): its stray entries in the sets are removed
--   {"<state>"}   the job is no longer in the state the caller found: nothing changed
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
local reserved_key = KEYS[4]
local counters_key = KEYS[5]
--- @include "gate"
--- @include "now_ms"
--- @include "format"
local refused = gate_ids(1, 1) or newer_rows({job_key}, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', job_key, 'state', 'token', 'requeued')
local state = row[1]
if not state then
  redis.call('ZREM', pending_key, ARGV[1])
  redis.call('ZREM', active_key, ARGV[1])
  redis.call('ZREM', reserved_key, ARGV[1])
  return {'missing'}
end
if state ~= ARGV[3] or (state ~= 'pending' and state ~= 'active') then
  return {state}
end
local now = now_ms()
local stall = tonumber(ARGV[2]) * math.min(2 ^ (tonumber(row[3]) or 0), 16)
if state == 'pending' then
  local since = redis.call('ZSCORE', pending_key, ARGV[1])
  if since and now - tonumber(since) < stall then
    return {'fresh'}
  end
  if tonumber(redis.call('ZSCORE', reserved_key, ARGV[1]) or '0') > now then
    return {'held'}
  end
else
  if row[2] ~= ARGV[4] then
    return {'stale'}
  end
  local deadline = redis.call('ZSCORE', active_key, ARGV[1])
  if deadline and tonumber(deadline) > now then
    return {'fresh'}
  end
  redis.call('ZREM', active_key, ARGV[1])
  redis.call('HSET', job_key, 'state', 'pending')
  redis.call('HDEL', job_key, 'skipped', 'replaced')
end
redis.call('ZADD', pending_key, now, ARGV[1])
redis.call('HDEL', job_key, 'suspect')
redis.call('HINCRBY', job_key, 'requeued', 1)
redis.call('HINCRBY', counters_key, 'republished', 1)
local stored = redis.call('HMGET', job_key, 'payload', 'delta', 'parent', 'input')
return {'requeued', stored[1], stored[2], stored[3], stored[4]}
