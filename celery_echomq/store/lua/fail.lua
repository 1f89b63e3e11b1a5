-- fail: a job failed for good (after Celery's retries), was revoked, or recovery found it
-- FAILURE in the result backend. The child's parent_policy decides what that means.
--
-- KEYS[1]   the job row
-- KEYS[2]   the job's queue pending set (its parent's, when on this slot; its window's)
-- KEYS[3]   the job's queue active set
-- KEYS[4]   the job's queue failed set (score: time of failure; trimmed to the result TTL)
-- KEYS[5]   the job's own :dependencies  } expired with the row when the job is itself a
-- KEYS[6]   the job's own :processed     } flow parent (ARGV[5] == '1')
-- KEYS[7]   the job's own :ignored       }
-- KEYS[8]   the queue's counters (also its children waiting in windows, includes/unwait.lua)
-- KEYS[9]   the queue's outbox (a parent on another slot: ARGV[7] == '1')
-- KEYS[10]  the queue's index of joined jobs to credit  } includes/join.lua: read only when
-- KEYS[11]  the job's :parents                          } the row says 'joined'
-- KEYS[12]  the parent row             } when the job is a child whose parent lives on this
-- KEYS[13]  the parent's :dependencies } slot; otherwise the queue's placeholder key
-- KEYS[14]  the parent's :processed    } (Keyspace.unused_key), which no script writes
-- KEYS[15]  the parent's :ignored      }
-- KEYS[16]  the window of the parent's children on this slot (includes/window.lua), or the
--           placeholder when the job has no parent; looked at only when the job's row says it
--           holds a slot of it ('windowed')
-- ARGV[1]   job id
-- ARGV[2]   the claim's token; '' accepts any (revoke, recovery, hard time limit)
-- ARGV[3]   the error, "ExcType: message"
-- ARGV[4]   result TTL in seconds
-- ARGV[5]   '1' when the job is a flow parent, else '0'
-- ARGV[6]   parent id ('' when none)
-- ARGV[7]   '1' when the parent lives on another slot: the child is staged in the outbox
--           (KEYS[9]) until credit.lua has applied its policy on the parent's slot
-- ARGV[8]   '1' to carry a nested flow's failure to its outer flow: the job is a nested
--           flow's parent that one of its own children failed (policy fail), or that was
--           cancelled, so it is failed or cancelled already; this applies that failure,
--           once, to the flow it is a child of
--           (ARGV[2] is then ignored). '0' otherwise
-- ARGV[9]   the options, a msgpack map (an option not given is not in it):
--   quorum  "K/N", the parent is released by the K-th success of its N children
--           (includes/quorum.lua): this failure is one child fewer that can succeed, and
--           fails the parent ("parent_failed") once fewer than K can; not given: none
--   unstarted  '1': fail the job only if it has not started (pending): a revoke its worker
--           learns of while the job waits its turn in a batch message the worker holds
--           (worker/batches.py); started or waiting for a window's slot: "stale", nothing
--           changed (not given: any state but a finished one)
--
-- A chain's step but its last (its row has 'next') expires the steps after it with its own row
-- (includes/chain_rest.lua: their rows, on this slot, named after its own).
--
-- Reply: {status, policy}
--   "failed"         the job failed; it has no parent here
--   "parent_failed"  policy fail: the parent is failed and will never run (the host records
--                    FAILURE for it and runs its error callbacks)
--   "released"       policy ignore/remove (the last outstanding child) or continue: the
--                    parent is now pending (the host dispatches it)
--   "credited"       policy ignore/remove/continue; the parent still waits or no longer waits
--   "staged"         staged in the outbox (ARGV[7] == '1'); policy is the child's own
--                    parent_policy or '' (the flow's default, read on the parent's slot)
--   "stale"          the token is not the current one: nothing changed
--   "forged"         ARGV[6] is not the row's own parent (a message's headers named
--                    another): nothing changed
--   "finished"       already done, failed or cancelled: nothing changed
--   "missing"        no row (forgotten, expired, or never written): nothing changed. A
--                    worker reports a revoked message it drops however late it comes (a
--                    cancelled flow forgotten while its messages still wait in the broker):
--                    writing the failure would bring the forgotten row back
--   A windowed child that was out (pending or active, or a nested flow carried) ends
--   its "parent_failed", "released", "credited" or "staged" reply with the next child of its
--   flow's window made pending: {"window", id, payload, delta, parent, now} (complete.lua)
-- A third element, 'edges', follows when the job was joined to more parents and was staged
-- for the host to settle it for them (before the window's list, which is always last).
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
local pending_key = KEYS[2]
local active_key = KEYS[3]
local failed_key = KEYS[4]
local deps_key = KEYS[5]
local processed_key = KEYS[6]
local ignored_key = KEYS[7]
local counters_key = KEYS[8]
local outbox_key = KEYS[9]
local joined_key = KEYS[10]
local parents_key = KEYS[11]
local parent_key = KEYS[12]
local parent_deps_key = KEYS[13]
local parent_processed_key = KEYS[14]
local parent_ignored_key = KEYS[15]
local window_key = KEYS[16]
--- @include "gate"
--- @include "expire"
--- @include "now_ms"
--- @include "settle_child"
--- @include "window"
--- @include "join"
--- @include "chain_rest"
--- @include "unwait"
--- @include "format"
local refused = gate_ids(1, 1)
if refused then
  return refused
end
local options = cmsgpack.unpack(ARGV[#ARGV])
local row = redis.call('HMGET', job_key, 'state', 'token', 'parent', 'next', 'joined',
  'windowed', 'chain', 'format')
refused = newer_format(row[8], job_key)
if refused then
  return refused
end
local state = row[1]
if not state then
  return {'missing', ''}
end
if (row[3] or '') ~= ARGV[6] then
  return {'forged', ''}
end
local now = now_ms()
local ttl = tonumber(ARGV[4])
if ARGV[8] == '1' then
  if (state ~= 'failed' and state ~= 'cancelled')
      or redis.call('HSETNX', job_key, 'propagated', '1') == 0 then
    return {'finished', ''}
  end
else
  if state == 'done' or state == 'failed' or state == 'cancelled' then
    return {'finished', ''}
  end
  if ARGV[2] ~= '' and (state ~= 'active' or row[2] ~= ARGV[2]) then
    return {'stale', ''}
  end
  if options.unstarted and state ~= 'pending' then
    return {'stale', ''}
  end
  redis.call('ZREM', pending_key, ARGV[1])
  redis.call('ZREM', active_key, ARGV[1])
  redis.call('ZADD', failed_key, now, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', failed_key, '-inf', now - ttl * 1000)
  redis.call('HSET', job_key, 'state', 'failed', 'error', ARGV[3])
  if ARGV[6] ~= '' then -- a child failed by its id while it waited for a slot of its window
    left_window(counters_key, state, row[7])
  end
  expire_keys(ttl, ARGV[5] == '1' and {job_key, deps_key, processed_key, ignored_key} or {job_key})
  if row[4] then
    -- A chain's step but its last: the steps waiting behind it never run unless a retry
    -- makes it pending again (repend persists them): they expire with it.
    expire_steps_after(job_key, ARGV[1], row[4], ttl)
  end
end
local shared = ARGV[8] ~= '1'
  and stage_edges(job_key, ARGV[1], joined_key, parents_key, row[5], ttl, nil)
local function reply(r)
  if shared then
    r[#r + 1] = 'edges'
  end
  return r
end
local policy = redis.call('HGET', job_key, 'parent_policy') or ''
-- A child of a flow without a window holds no slot ('windowed' is on every child of one that
-- has), nor does a waiting child failed by its id (revoked): it frees none.
-- (A child's row has a parent: ARGV[6].)
local window = row[6] and state ~= 'waiting' and ARGV[6] ~= '' and window_key or nil
if ARGV[7] == '1' then
  redis.call('ZADD', outbox_key, now, ARGV[1])
  return window_reply(reply({'staged', policy}), window, pending_key, counters_key, ttl)
end
if ARGV[6] == '' then
  return reply({'failed', ''})
end
local parent = {id = ARGV[6], row = parent_key, deps = parent_deps_key,
  processed = parent_processed_key, ignored = parent_ignored_key, pending = pending_key,
  failed = failed_key, counters = counters_key, quorum = options.quorum}
return window_reply(reply(settle_child(parent, ARGV[1], 'failed', ARGV[3], policy, ttl)),
  window, pending_key, counters_key, ttl)
