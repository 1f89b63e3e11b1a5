-- deadline: a flow's deadline passed while its parent still waits for its children (one
-- atomic step on the parent's slot, run by whichever worker polls the index first). Under
-- 'fail' the parent fails (it will never run); under 'continue' it is released with the
-- values completed so far. Either way the children that have not started are cut
-- (cut_pending): a chunk of those on this slot here, atomically with the parent, the rest by
-- the host after it (deadline_cut, a chunk per call, so that no call of a flow of 100,000
-- children blocks Redis); running ones finish and are recorded, never releasing it again. The
-- index entry stays, re-scored a follow-up lease ahead, until the host has done what follows
-- (record the failure, dispatch the parent, revoke the cut messages) and called deadline_done:
-- a host that dies in between leaves the entry, which comes due again ('fired').
--
-- KEYS[1]    the parent row
-- KEYS[2]    the parent's :dependencies  }
-- KEYS[3]    the parent's :processed     } expire with the parent when it fails
-- KEYS[4]    the parent's :ignored       }
-- KEYS[5]    the parent's :settled       } (children of other slots already credited)
-- KEYS[6]    the queue's pending set
-- KEYS[7]    the queue's failed set
-- KEYS[8]    the queue's counters (a parent fewer held; 'deadlines' counts each one fired;
--            'children_cut')
-- KEYS[9]    the queue's deadline index
-- KEYS[9+i]  child i's row, i = 1..N (the first chunk of the children on this slot)
-- ARGV[1]    parent id
-- ARGV[2]    what says the children the host read are still all of them (add_children grows
--            a flow): 'n:<count>', the length of the parent's index of children
--            ('<parent row>:children', named from KEYS[1]) when it read them there, or the
--            SHA1 of the payload it read them from, for a flow kept without an index
-- ARGV[3]    'fail' or 'continue' (the flow's on_deadline, read from that payload)
-- ARGV[4]    result TTL in seconds
-- ARGV[5]    the follow-up lease in ms
-- ARGV[6]    N
-- ARGV[6+i]  child i's id, i = 1..N
-- ARGV[7+N..] ids of the first chunk of the children on other slots (outstanding unless in
--            :settled)
--
-- Reply: {status, due, fired, ncut, nrunning, nremote, outstanding, ids...}: outstanding is
-- how many children the parent still waited for (its :dependencies); ids are the children of
-- the chunks cut here, then those still running here (active, or held nested flows), then the
-- unsettled children of other slots (the host cuts those on their slots)
--   "failed"    on_deadline fail: the parent is failed by its deadline
--   "released"  on_deadline continue: the parent is pending (the host dispatches it)
--   "fired"     already fired, its follow-up lease lapsed: the host does the follow-up again
--               (reply {status, due, fired, outcome}: 'failed' or 'released')
--   "early"     the deadline has not passed (reply {status, due}); nothing changed
--   "stale"     the payload changed since the host read it (children added): read again
--   "moot"      the parent no longer waits (done, failed, cancelled, released...): the entry
--               is removed (reply {status, state})
--   "missing"   no row: the flow never landed, or expired; the entry is removed
--   "noop"      no entry (disarmed or done), or another worker's follow-up lease is live
-- Errors: "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local processed_key = KEYS[3]
local ignored_key = KEYS[4]
local settled_key = KEYS[5]
local pending_key = KEYS[6]
local failed_key = KEYS[7]
local counters_key = KEYS[8]
local deadlines_key = KEYS[9]
local children_at = 9 -- child i's row is KEYS[children_at + i]
--- @include "gate"
--- @include "keys"
--- @include "now_ms"
--- @include "expire"
--- @include "release_parent"
--- @include "cut_pending"
--- @include "format"
local n = tonumber(ARGV[6])
local refused = gate_ids(1, 1) or gate_ids(7, #ARGV) or newer_rows({parent_key}, 1)
if refused then
  return refused
end
local id = ARGV[1]
local due = redis.call('ZSCORE', deadlines_key, id)
if not due then
  return {'noop'}
end
due = tonumber(due)
local now = now_ms()
local row = redis.call('HMGET', parent_key, 'state', 'deadline_fired', 'failed_by')
if not row[1] then
  redis.call('ZREM', deadlines_key, id)
  return {'missing'}
end
if row[2] then
  if due > now then
    return {'noop'}
  end
  redis.call('ZADD', deadlines_key, now + tonumber(ARGV[5]), id)
  local at = redis.call('HGET', parent_key, 'deadline_at')
  return {'fired', at, row[2], row[3] == 'deadline' and 'failed' or 'released'}
end
if due > now then
  return {'early', due}
end
if row[1] ~= 'awaiting_children' then
  redis.call('ZREM', deadlines_key, id)
  redis.call('HSET', parent_key, 'deadline_at', due)
  return {'moot', row[1]}
end
-- A flow of 100,000 children is checked by its index's length: its payload (every child's
-- id) is neither read nor hashed here.
local listed = string.match(ARGV[2], '^n:(%d+)$')
local fresh
if listed then
  fresh = redis.call('LLEN', children_of(parent_key)) == tonumber(listed)
else
  fresh = redis.sha1hex(redis.call('HGET', parent_key, 'payload') or '') == ARGV[2]
end
if not fresh then
  return {'stale'}
end
local ttl = tonumber(ARGV[4])
local why = 'FlowDeadlineExceeded: flow ' .. id .. ' passed its deadline before this child started'
local cut, running, remote = {}, {}, {}
for i = 1, n do
  local child, cid = KEYS[children_at + i], ARGV[6 + i]
  if cut_pending(child, cid, id, pending_key, ttl, why, counters_key) then
    cut[#cut + 1] = cid
  else
    local s = redis.call('HGET', child, 'state')
    if s == 'active' or s == 'awaiting_children' then
      running[#running + 1] = cid
    end
  end
end
for i = 7 + n, #ARGV do
  if redis.call('HEXISTS', settled_key, ARGV[i]) == 0 then
    remote[#remote + 1] = ARGV[i]
  end
end
-- Every child the parent still waited for, in the chunks or not: its counter.
local outstanding = math.max(tonumber(redis.call('GET', deps_key) or '0') or 0,
  #cut + #running + #remote)
local named = {}
for _, list in ipairs({cut, running, remote}) do
  for _, cid in ipairs(list) do
    if #named < 10 then
      named[#named + 1] = cid
    end
  end
end
local text = 'FlowDeadlineExceeded: flow ' .. id .. ' passed its deadline with ' .. outstanding
  .. ' children outstanding'
if #named > 0 then
  text = text .. ': ' .. table.concat(named, ', ')
  if outstanding > #named then
    text = text .. ' and ' .. (outstanding - #named) .. ' more'
  end
end
redis.call('HSET', parent_key, 'deadline_at', due, 'deadline_fired', now,
  'deadline_outstanding', outstanding)
if #cut > 0 then
  -- Counted as cut: the flow ended without them (reads.counts_of; retry_deadline counts
  -- back those it runs again).
  redis.call('HINCRBY', parent_key, 'cut_children', #cut)
  redis.call('HINCRBY', counters_key, 'children_cut', #cut)
end
redis.call('HINCRBY', counters_key, 'deadlines', 1)
local status
if ARGV[3] == 'continue' then
  release_parent(parent_key, pending_key, id, counters_key)
  redis.call('HSET', parent_key, 'released_by', 'deadline')
  status = 'released'
else
  redis.call('HSET', parent_key, 'state', 'failed', 'failed_by', 'deadline', 'error', text)
  redis.call('ZADD', failed_key, now, id)
  redis.call('HINCRBY', counters_key, 'held', -1)
  expire_keys(ttl, {parent_key, deps_key, processed_key, ignored_key, settled_key})
  status = 'failed'
end
redis.call('ZADD', deadlines_key, now + tonumber(ARGV[5]), id)
local reply = {status, due, now, #cut, #running, #remote, outstanding}
for _, list in ipairs({cut, running, remote}) do
  for _, cid in ipairs(list) do
    reply[#reply + 1] = cid
  end
end
return reply
