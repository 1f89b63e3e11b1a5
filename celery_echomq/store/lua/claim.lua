-- claim: a worker starts a job (task_prerun): pending -> active under a new token and a lease.
--
-- KEYS[1]  the job row
-- KEYS[2]  the queue's pending set
-- KEYS[3]  the queue's active set (score: when the holder's lease lapses)
-- KEYS[4]  the queue's claim marks (hash: priority -> the latest pending-since of a job the
--          queue has delivered): the evidence recovery reads to tell a backlog from a loss
-- KEYS[5]  the queue's counters (hash)
-- (No reserved set: the worker's lease loop ends the holds it made, in one extend call per
-- tick, rather than every claim paying a ZREM for a hold that rarely exists.)
-- ARGV[1]  job id
-- ARGV[2]  the new token
-- ARGV[3]  lease in ms: the holder's lease lapses at server time + lease unless renewed
-- ARGV[4]  the delivery's priority ('0' when none): the claim mark to advance
-- ARGV[5]  '1' to take over a live lease: the caller knows the holder is dead
-- ARGV[6]  the delivery's retry count (Celery's request.retries): a retry's message can
--          arrive before the delivery that sent it has finished; it supersedes that one
-- ARGV[7]  the options, a msgpack map (an option not given is not in it):
--   mark    a claim mark the caller knows the queue has already reached for this priority
--           (marks only grow): a job pending since no later than that leaves the marks unread
--           and unwritten (not given: always compare)
--   since   when the job became pending, as its producer read the server's clock just before
--           enqueueing it (the message's echomq_t header), no later than its pending score:
--           spares the ZSCORE. A message re-published by recovery, or retried, carries an
--           older time or none (not given: read the score), which can only leave a mark
--           lower, never claim that a job was delivered later than it was
--   parent  the parent id the delivery's message names ('' for none). The row's own
--           'parent' decides: a message that names another (a forged or copied header)
--           claims nothing (not given: not compared, for a caller that knows no message)
--   batch   the id of the batch message that carried this delivery (worker/batches.py),
--           kept as the row's 'batch' (not given: a message of its own, and a 'batch' an
--           earlier delivery left is removed)
--
-- Reply: {status, attempts, holder, mark}
--   mark: the claim mark this priority is now known to have reached ('' when this claim
--   did not look), for the caller to pass as options.mark next time
--   "claimed"     pending -> active
--   "taken_over"  it was active under another token whose lease had lapsed, whose holder the
--                 caller knows to be dead, or whose delivery this one retries: that token is
--                 now stale
--   "busy"        active under a live lease (or handed over to a replacement task): this
--                 delivery is a duplicate; nothing changed but the row's 'skipped' count;
--                 holder is the live token
--   "done" | "failed" | "cancelled"   already finished: nothing changed but the counters
--   "held"        a parent still awaiting its children: nothing changed
--   "missing"     no row (never written, or expired): nothing changed
--   "forged"      the message names another parent than the row: nothing changed but the
--                 queue's 'forged_refused' count
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
local marks_key = KEYS[4]
local counters_key = KEYS[5]
--- @include "gate"
--- @include "now_ms"
--- @include "format"
local refused = gate_ids(1, 1)
if refused then
  return refused
end
local options = cmsgpack.unpack(ARGV[#ARGV])
local row = redis.call('HMGET', job_key, 'state', 'attempts', 'token', 'replaced', 'retries',
  'skipped', 'suspect', 'parent', 'format', 'batch')
refused = newer_format(row[9], job_key)
if refused then
  return refused
end
local state = row[1]
if not state then
  return {'missing', 0, '', ''}
end
if options.parent and options.parent ~= (row[8] or '') then
  redis.call('HINCRBY', counters_key, 'forged_refused', 1)
  return {'forged', tonumber(row[2]) or 0, '', ''}
end
if state == 'awaiting_children' then
  return {'held', 0, '', ''}
end
local attempts = tonumber(row[2]) or 0
if state ~= 'pending' and state ~= 'active' then
  redis.call('HINCRBY', counters_key, 'duplicates_skipped', 1)
  return {state, attempts, '', ''}
end
local retries = tonumber(ARGV[6])
local now = now_ms()
if state == 'active' and ARGV[5] ~= '1' and retries <= (tonumber(row[5]) or 0) then
  local lease = tonumber(redis.call('ZSCORE', active_key, ARGV[1]) or '0')
  if row[4] or lease > now then
    redis.call('HINCRBY', job_key, 'skipped', 1)
    redis.call('HINCRBY', counters_key, 'duplicates_skipped', 1)
    return {'busy', attempts, row[3] or '', ''}
  end
end
local mark = ''
if state == 'pending' then
  -- Brokers deliver one queue (per priority) in order: this delivery shows that every job of
  -- the same priority that became pending well before it has been delivered too. The
  -- children of one flow share one pending time, so the caller's known mark spares most
  -- claims the read of the marks hash.
  local raw = options.since
  if not raw then
    raw = redis.call('ZSCORE', pending_key, ARGV[1])
  end
  local since = tonumber(raw or '0')
  if raw and since > (tonumber(options.mark) or 0) then
    local current = tonumber(redis.call('HGET', marks_key, ARGV[4]) or '0')
    if since > current then
      redis.call('HSET', marks_key, ARGV[4], raw)
      current = since
    end
    mark = current
  end
  redis.call('ZREM', pending_key, ARGV[1])
end
attempts = attempts + 1
-- Numbers go to Redis as strings made here ('%d'): a Lua number passed to redis.call is
-- printed with '%.17g', which costs the server several times more (the same digits for these
-- integers). 'retries' is the host's own decimal.
local started, attempted = string.format('%d', now), string.format('%d', attempts)
if options.batch then
  redis.call('HSET', job_key, 'state', 'active', 'token', ARGV[2], 'started', started,
    'attempts', attempted, 'retries', ARGV[6], 'batch', options.batch)
else
  redis.call('HSET', job_key, 'state', 'active', 'token', ARGV[2], 'started', started,
    'attempts', attempted, 'retries', ARGV[6])
  if row[10] then
    redis.call('HDEL', job_key, 'batch') -- this delivery is a message of its own
  end
end
if row[4] or row[6] or row[7] then
  redis.call('HDEL', job_key, 'skipped', 'replaced', 'suspect')
end
redis.call('ZADD', active_key, string.format('%d', now + tonumber(ARGV[3])), ARGV[1])
if state == 'active' then
  return {'taken_over', attempts, row[3] or '', mark}
end
return {'claimed', attempts, '', mark}
