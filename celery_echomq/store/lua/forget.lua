-- forget: delete jobs and their flows' keys on one queue's slot (any state -> gone): what
-- `echomq forget` deletes of a flow (ops/forget.py: a chunk of its children, then its parent
-- with the parent's own keys), and what the undo of a refused start (send/start.py) takes
-- back of what it wrote. In the same step each job leaves the queue's sets, a parent held
-- (awaiting_children) leaves the queue's 'held' count, and a child waiting for a slot of its
-- flow's window leaves 'window_waiting' (includes/unwait.lua): the counts the dashboard reads
-- never keep a job that is gone.
--
-- A cancelled child's message may still wait in its queue, and its row is what turns that
-- message away (the claim finds it cancelled), so with ARGV[2+N] > 0 a cancelled row with a
-- parent is not deleted but cut down to its state and parent, expiring when the row would
-- have (after ARGV[2+N] ms when it had no TTL).
--
-- KEYS[1]      the queue's counters
-- KEYS[2..11]  the queue's job sets: pending, active, failed, outbox, open, recent, adding,
--              deadlines, joined, reserved (Keyspace.job_set_keys)
-- KEYS[11+i]   job i's row, i = 1..N; a row deleted takes its ':parents' with it (the
--              parents it was joined to: on_exists="join"), named from it by includes/keys.lua
-- KEYS[12+N..] the flows' own keys deleted with them (Keyspace.flow_own_keys: :dependencies,
--              :children, :window, :quorum, ...)
-- ARGV[1]      N, how many jobs
-- ARGV[1+i]    job i's id
-- ARGV[2+N]    ms a cut-down cancelled row lives when its row had no TTL; '0': no row is
--              cut down, a cancelled one is deleted as any other (the undo of a start)
--
-- Reply: {deleted, kept}: deleted the names of the keys that were there and are gone (a row
-- cut down is not among them), kept the ids of the rows cut down; a second run deletes
-- nothing and keeps what the first kept.
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQFORMAT <found> <known> <row>" a
-- row of a newer store format (includes/format.lua).
local counters_key = KEYS[1]
local sets_at = 1 -- the queue's job sets are KEYS[sets_at + 1 .. rows_at]
local rows_at = 11 -- job i's row is KEYS[rows_at + i], the flows' own keys after them
--- @include "gate"
--- @include "keys"
--- @include "unwait"
--- @include "format"
local n = tonumber(ARGV[1])
local refused = gate_ids(2, 1 + n) or newer_rows(KEYS, rows_at + 1, rows_at + n)
if refused then
  return refused
end
local keep_ms = tonumber(ARGV[2 + n])
local deleted, kept, ids = {}, {}, {}
for i = 1, n do
  local row, id = KEYS[rows_at + i], ARGV[1 + i]
  local job = redis.call('HMGET', row, 'state', 'parent', 'chain')
  local state = job[1]
  if state == 'awaiting_children' then
    redis.call('HINCRBY', counters_key, 'held', -1)
  end
  if state then
    left_window(counters_key, state, job[3])
  end
  if state == 'cancelled' and job[2] and keep_ms > 0 then
    local ttl = redis.call('PTTL', row)
    redis.call('DEL', row)
    redis.call('HSET', row, 'state', 'cancelled', 'parent', job[2])
    redis.call('PEXPIRE', row, ttl > 0 and ttl or keep_ms)
    kept[#kept + 1] = id
  elseif redis.call('UNLINK', row) == 1 then
    deleted[#deleted + 1] = row
    local edges = parents_of(row)
    if redis.call('UNLINK', edges) == 1 then
      deleted[#deleted + 1] = edges
    end
  end
  ids[#ids + 1] = id
end
for i = rows_at + n + 1, #KEYS do
  if redis.call('UNLINK', KEYS[i]) == 1 then
    deleted[#deleted + 1] = KEYS[i]
  end
end
if n > 0 then
  for set = sets_at + 1, rows_at do
    redis.call('ZREM', KEYS[set], unpack(ids))
  end
end
return {deleted, kept}
