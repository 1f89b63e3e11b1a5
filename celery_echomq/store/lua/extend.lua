-- extend: a live worker renews its leases: on the flow jobs it is running (their deadlines in
-- the active set) and on those it has received but not started yet (prefetched, or waiting
-- for an eta), so recovery never takes a long task, or a job in a worker's buffer, for a lost
-- one (as BullMQ's workers renew their job locks).
--
-- KEYS[1]   the queue's active set (score: when the holder's lease lapses)
-- KEYS[2]   the queue's reserved set (score: when the worker's hold on a received job lapses)
-- KEYS[2+j] the row of the j-th running job, j = 1..n
-- ARGV[1]   lease in ms: each lease becomes at least server time + lease
-- ARGV[2]   n, the number of running job ids that follow
-- ARGV[3]   m, the number of held job ids that follow them
-- ARGV[4..] n ids of the jobs this worker is running on that queue, then m ids of the jobs
--           it holds without running them yet, then the ids of jobs whose hold ended (this
--           worker held them and has since started them, or they are gone)
--
-- Reply: the number of leases moved. A running job that is not in the active set (finished,
-- failed, retried, or not claimed yet) is left out: this script never makes a job active, and
-- never shortens a lease. Nor is one whose body handed it over to a replacement (its row says
-- 'replaced', hand_over.lua): a worker can still list its request as running for a moment
-- after the hand-over, and a renewal then would put recovery's look at the replacement's
-- outcome a whole lease later. A held job's entry is dropped here, by the worker that made it, on
-- its next tick after the job started (not by the claim: most jobs start before any tick has
-- held them, and a claim would pay a ZREM for nothing), and lapses on its own if its worker
-- dies. An entry left a moment after its claim is harmless: recovery reads the reserved set
-- only for pending jobs.
-- Errors: "EMQKIND ..." a non-JOB id (checked for every id before any write).
local active_key = KEYS[1]
local reserved_key = KEYS[2]
local running_at = 2 -- the j-th running job's row is KEYS[running_at + j]
--- @include "gate"
--- @include "now_ms"
local refused = gate_ids(4, #ARGV)
if refused then
  return refused
end
local deadline = now_ms() + tonumber(ARGV[1])
local running = 3 + tonumber(ARGV[2])
local held = running + tonumber(ARGV[3])
local moved = 0
if #ARGV > held then
  redis.call('ZREM', reserved_key, unpack(ARGV, held + 1, #ARGV))
end
for i = 4, held do
  local current = redis.call('ZSCORE', (i <= running and active_key or reserved_key), ARGV[i])
  if i <= running then
    local replaced = redis.call('HEXISTS', KEYS[running_at + i - 3], 'replaced') == 1
    if current and tonumber(current) < deadline and not replaced then
      redis.call('ZADD', active_key, deadline, ARGV[i])
      moved = moved + 1
    end
  elseif not current or tonumber(current) < deadline then
    redis.call('ZADD', reserved_key, deadline, ARGV[i])
    moved = moved + 1
  end
end
return moved
