-- complete: a job succeeded (task_success): active -> done, and its parent's fan-in.
--
-- KEYS[1]  the job row
-- KEYS[2]  the job's queue active set
-- KEYS[3]  the job's own :dependencies  } expired with the row when the job is itself a
-- KEYS[4]  the job's own :processed     } flow parent (ARGV[4] == '1'): a finished flow
-- KEYS[5]  the job's own :ignored       } must not outlive the result TTL
-- KEYS[6]  the queue's pending set (its parent's, when on this slot; its next step's; its
--          window's)
-- KEYS[7]  the queue's counters
-- KEYS[8]  the queue's outbox (a parent on another slot: ARGV[7] == '1')
-- KEYS[9]  the queue's index of joined jobs to credit  } includes/join.lua: read only
-- KEYS[10] the job's :parents                          } when the row says 'joined'
-- KEYS[11] the parent row            } when the job is a child whose parent lives on this
-- KEYS[12] the parent's :dependencies } slot; otherwise the queue's placeholder key
-- KEYS[13] the parent's :processed    } (Keyspace.unused_key), which no script writes
-- KEYS[14] the window of the parent's children on this slot (includes/window.lua), or the
--          placeholder when the job has no parent; looked at only when the job's row says it
--          holds a slot of it ('windowed')
-- KEYS[15] the next step's row (options.next), or the placeholder
-- KEYS[16] the job's key in Celery's Redis result backend (options.result), or the placeholder
-- ARGV[1]  job id
-- ARGV[2]  the token the claim gave this delivery
-- ARGV[3]  result TTL in seconds for the finished row
-- ARGV[4]  '1' when the job is a flow parent, else '0'
-- ARGV[5]  parent id ('' when none)
-- ARGV[6]  the job's value, serialized
-- ARGV[7]  '1' when the parent lives on another slot: the value is kept on the row and the
--          child staged in the outbox (KEYS[8]) until credit.lua has counted it on the
--          parent's slot
-- ARGV[8]  the options, a msgpack map (an option not given is not in it):
--   result   the result's encoded meta, exactly as Celery's RedisBackend would store it: this
--            script writes it to KEYS[16] (the worker held Celery's own write back and the
--            store's server and db are the result backend's; see wire/results.py, which
--            computes the key and each option of the result)
--   expires  with result: its expiry in seconds (the backend's result_expires); not given:
--            none
--   channel  with result: the channel it is published on (Celery's: the key's own name)
--   inline   when this completion releases its parent (on this slot), hand the host the
--            parent to publish, as dispatch.lua would, inlining at most this many values (not
--            given: the host calls dispatch itself)
--   next     the next step's id, on a chain's step but its last (its row's 'next'); then the
--            value goes to that step (KEYS[15]), not to a parent. A flow parent may be one
--            (ARGV[4] == '1'): a chain's step held on its children
--   lease    with next: a lease in ms. The next step is then handed out active rather than
--            made pending: its row 'active' with no token and 'attempts' 1, its lease in the
--            active set lapsing at server time + this, its 'started' the server time (its
--            pending time, should recovery find it never taken). The first delivery of its
--            message takes it by writing the token a claim would (HSETNX, see
--            take_handed.lua), in place of the claim script (not given: made pending)
--   quorum   "K/N", the job's flow is released by the K-th success of its N children
--            (flow(..., quorum=K), includes/quorum.lua); not given: by the last of them
--   reduce   the reducer (JSON) the job's flow folds its children's values with
--            (flow(..., reduce=R), includes/reduce.lua), into the parent row's 'acc' as it
--            credits this child; not given: none
--
-- Reply: {status, written}: written '1' when this call wrote options.result (the job's one
-- active -> done transition), else '' (the host stores it the way Celery would, which never
-- overwrites a SUCCESS); with or without a result, written ends in '+' when the job was
-- joined to more parents and staged for the host to credit them
--   "released"    credited, and it was the last outstanding child: the parent is now pending
--                 (the host dispatches it); with options.inline, the reply goes on with what
--                 dispatch.lua replies: {"released", written, payload, "inline", id1,
--                 value1, ...} or {"released", written, payload, "scan"}
--   "credited"    credited; other children outstanding, or the parent no longer waits
--   "staged"      finished and staged in the outbox (ARGV[7] == '1'): the host credits it
--   "advanced"    a chain's step: finished, and the next step is now pending (or, with
--                 options.lease, active with no token) with this value as its 'input'; the reply
--                 goes on with that step's payload, for the host to publish: {"advanced",
--                 written, payload, now} (now: its pending score, the server's ms, which its
--                 message carries so that its claim need not read it)
--   "done"        finished; no parent to credit (or the next step no longer waits)
--   A windowed child's "released", "credited" or "staged" reply ends with the next
--   child of its flow's window made pending, as a list: {"window", id, payload, delta,
--   parent, now} (one of payload and delta ''), for the host to publish
--   "stale"       the token is not the current one: nothing changed
--   "forged"      ARGV[5] is not the row's own parent, or options.next its own next step (a
--                 message's headers named another): nothing changed
--   "<state>"     the job is not active (done, failed, pending, ...): nothing changed
--   "released" or "credited" under a quorum: the K-th success, or one before it
--   "unfoldable"  {"unfoldable", '', reason}: the flow's reducer cannot fold this value;
--                 nothing written (the host fails the child with the reason, under its policy)
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local active_key = KEYS[2]
local deps_key = KEYS[3]
local processed_key = KEYS[4]
local ignored_key = KEYS[5]
local pending_key = KEYS[6]
local counters_key = KEYS[7]
local outbox_key = KEYS[8]
local joined_key = KEYS[9]
local parents_key = KEYS[10]
local parent_key = KEYS[11]
local parent_deps_key = KEYS[12]
local parent_processed_key = KEYS[13]
local window_key = KEYS[14]
local next_key = KEYS[15]
local result_key = KEYS[16]
--- @include "gate"
--- @include "expire"
--- @include "holder"
--- @include "settle_child"
--- @include "hand_out"
--- @include "join"
--- @include "reduce"
-- The window's functions (includes/window.lua) are made only when a child that holds a slot
-- of one finishes: a script's local functions are made anew on every call, a dozen of them
-- for the window, which a flow without one never calls. (What window.lua includes, now_ms and
-- format, is included above, at the top: the loader writes a piece once, where it first
-- appears, and the rest of this script reads them.)
local function window_functions()
--- @include "window"
  return window_reply
end

-- window_reply's reply: ``reply`` as it is when ``window`` is nil.
local function with_window(reply, window, pending, counters, ttl)
  if not window then
    return reply
  end
  return window_functions()(reply, window, pending, counters, ttl)
end
local refused = gate_ids(1, 1)
if refused then
  return refused
end
local options = cmsgpack.unpack(ARGV[#ARGV])
local is_parent = ARGV[4] == '1'
local next_id = options.next or ''
-- A parent's credited_failed, read with its holder: its :ignored exists only once a child
-- failed under 'ignore', which counts credited_failed in the same script (settle_child).
-- Any other job's 'next' (a chain's step), which must be the one the message names: a step
-- is never taken for the chain's last, nor the last for a step.
-- A flow parent that is a chain's step (the step held on its children, the tasks after it
-- waiting) is read for its 'next' as any step is, and all its own keys expired.
-- And whether the job holds a slot of its flow's window ('windowed', written on every child
-- of a flow with max_active): only then is the window looked at, so a child of a flow without
-- one finishes without that read.
local stepping = not is_parent or next_id ~= ''
local failed_children, joined, windowed
refused, failed_children, joined, windowed = not_holder(job_key, ARGV[2],
  stepping and 'next' or 'credited_failed', ARGV[5], 'joined', 'windowed')
if refused then
  return refused
end
if stepping then
  if (failed_children or '') ~= next_id then
    return {'forged'}
  end
  failed_children = is_parent or nil
end
-- A value its flow's reducer folds, checked before any write (an active child's parent is
-- on this slot: ARGV[7] is '0' for a reducer's children, which send/fan_in.py refuses
-- elsewhere); written into the parent's 'acc' only where it is credited, once.
local acc
if options.reduce and ARGV[5] ~= '' and next_id == '' and ARGV[7] ~= '1' then
  local reason
  acc, reason = fold_value(options.reduce, redis.call('HGET', parent_key, 'acc'), ARGV[6])
  if not acc then
    return {'unfoldable', '', reason}
  end
end
local ttl = tonumber(ARGV[3])
-- The window of a child that holds a slot of it (a child's row has a parent: ARGV[5]).
local window = windowed and ARGV[5] ~= '' and window_key or nil
-- ZREM gives was_active: exactly one completion per active->done transition gets 1.
local was_active = redis.call('ZREM', active_key, ARGV[1])
redis.call('HSET', job_key, 'state', 'done')
-- A finished job's message is read again by nothing its flow's readers need but show, which
-- prints its task and arguments. One of 64 KiB or more is cut down now, rather than kept for
-- the result TTL: its task stays, its arguments become a marker ('dropped': the size cut).
-- A child's own message (payload or delta); a flow parent's template of its children's
-- messages once it is done with no child failed (none can be retried), never its own
-- payload, which on_exists='join' compares. Only a JSON message is cut (the app's default
-- serializer); any other stays whole.
local big = 65536
local function cut(field, whole)
  local size = redis.call('HSTRLEN', job_key, field)
  if size < big then
    return
  end
  local stored = redis.call('HGET', job_key, field)
  if string.sub(stored, 1, 1) ~= '{' then
    return
  end
  local task = string.match(string.sub(stored, 1, 300), '^{"task": ?"([^"]*)"')
  if whole and not task then
    return
  end
  local mark = '"args": ["<dropped: ' .. size .. ' bytes>"], "kwargs": {}'
  local head = task and ('{"task": "' .. task .. '", ') or '{'
  redis.call('HSET', job_key, field, head .. mark .. (whole and ', "options": {}}' or '}'),
    'dropped', size)
end
if not is_parent then
  cut('payload', true)
  cut('delta', false)
elseif not failed_children then
  cut('template', true)
end
-- The TTL as the host's decimal (ARGV[3]): a Lua number passed to redis.call is printed with
-- '%.17g' on every call. A job that is not a parent has its row alone to expire.
if not is_parent then
  redis.call('EXPIRE', job_key, ARGV[3])
elseif failed_children then
  expire_keys(ARGV[3], {job_key, deps_key, processed_key, ignored_key})
else
  expire_keys(ARGV[3], {job_key, deps_key, processed_key})  -- no :ignored to expire
end
local written = ''
if options.result and was_active == 1 then
  -- What RedisBackend._set sends (SETEX or SET, then PUBLISH on the channel a waiting
  -- AsyncResult.get listens to), once: a stale or duplicate completion never rewrites it. Before
  -- the fan-in, so a released parent's waiter finds every child's result already stored.
  if options.expires then
    redis.call('SET', result_key, options.result, 'EX', options.expires)
  else
    redis.call('SET', result_key, options.result)
  end
  redis.call('PUBLISH', options.channel, options.result)
  written = '1'
end
if was_active == 1 and stage_edges(job_key, ARGV[1], joined_key, parents_key, joined, ttl, ARGV[6])
    then
  written = written .. '+' -- its other parents, for the host to credit
end
if next_id ~= '' then
  -- A chain's step: its value goes to the next step, which becomes pending, and this worker
  -- publishes it (recovery re-publishes it if that never happens). Once, inside was_active.
  if was_active == 1 then
    local after = redis.call('HMGET', next_key, 'state', 'payload')
    if after[1] == 'waiting' then
      local now = now_ms()
      local lease = tonumber(options.lease)
      if lease then
        -- Handed out: the claim its worker would make is made here (the same slot: a linked
        -- run's steps share a queue), but for the token, which its first delivery writes.
        redis.call('HSET', next_key, 'state', 'active', 'input', ARGV[6], 'started', now,
          'attempts', '1')
        redis.call('ZADD', active_key, now + lease, next_id)
      else
        redis.call('HSET', next_key, 'state', 'pending', 'input', ARGV[6])
        redis.call('ZADD', pending_key, now, next_id)
      end
      return {'advanced', written, after[2], now}
    end
  end
  return {'done', written}
end
if ARGV[7] == '1' then
  if was_active == 1 then
    redis.call('HSET', job_key, 'value', ARGV[6])
    redis.call('ZADD', outbox_key, now_ms(), ARGV[1])
    return with_window({'staged', written}, window, pending_key, counters_key, ttl)
  end
  return {'done', written}
end
-- The fan-in: EXACTLY once per child, inside was_active == 1, so a redelivered or stale
-- completion never re-enters it.
if ARGV[5] ~= '' and was_active == 1 then
  local parent = {id = ARGV[5], row = parent_key, deps = parent_deps_key,
    processed = parent_processed_key, pending = pending_key, counters = counters_key,
    quorum = options.quorum, acc = acc}
  local settled = settle_child(parent, ARGV[1], 'done', ARGV[6], '', ttl)[1]
  if settled == 'released' and (parent.quorum or '') ~= '' then
    window = nil -- its quorum met: the children waiting for a slot are cut, none goes out
  end
  if settled == 'released' and options.inline then
    -- The one completion that released the parent publishes it: no dispatch call after.
    local payload = redis.call('HGET', parent.row, 'payload')
    local reply = hand_out(parent.row, parent.processed, parent.counters, payload,
      tonumber(options.inline), now_text())
    table.insert(reply, 1, written)
    table.insert(reply, 1, settled)
    return with_window(reply, window, pending_key, counters_key, ttl)
  end
  return with_window({settled, written}, window, pending_key, counters_key, ttl)
end
return {'done', written}
