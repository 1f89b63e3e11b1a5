--- @include "expire"
--- @include "now_ms"
--- @include "release_parent"
--- @include "quorum"
--- @include "keys"
-- settle_child(parent, child_id, outcome, data, policy, ttl): the fan-in, on the parent's
-- slot. Every script that counts a finished child toward its parent calls this: complete and
-- fail when the parent shares the child's slot, credit for a child of another slot. The
-- caller has already made sure this runs once per child (the child's was_active, or the
-- parent's :settled set).
--
-- parent   {id, row, deps, processed, ignored, pending, failed, settled, counters, quorum, acc}:
--          the parent's id and keys (settled: its :settled hash on the cross-slot path, else nil;
--          counters: its queue's counters hash, which counts releases, parents held and
--          failed children per policy; quorum: "K/N" for a flow released by its K-th
--          success of N children, includes/quorum.lua, else nil or ''; acc: the parent's
--          accumulator with this child's value folded in, includes/reduce.lua, else nil)
-- outcome  'done' (data: the child's value) or 'failed' (data: "ExcType: message")
-- policy   the failed child's parent_policy; '' reads the flow's default from the parent row
--
-- What a failed child means for its parent, by policy:
--   fail      the parent fails and will never run (if it still waits; else nothing changes)
--   ignore    counted as resolved; the error kept in the parent's :ignored
--   remove    counted as resolved
--   continue  counted as resolved, and the parent is released at once if it still waits
--   fail_at_end  counted as resolved, and the parent fails once no child is outstanding, as a
--             Celery chord's body fails after its whole header has run: the row's
--             'late_failed' counts such children and 'late_child' names the first (the one
--             that failed the parent, unless a retry took it back)
-- Whatever the policy, the flow keeps what failed (failed_children() reads it): under ignore
-- in :ignored, under the others as the parent row's field 'failed:<child id>' (the error),
-- with 'failed_children' counting those fields, so that dependencies() can tell a child
-- failed under fail (never counted down) from one still outstanding. On the row, not in a
-- key of its own: it lives and expires with the flow, and no script takes one more key.
--
-- The same rules, as the table eager mode executes (it runs with no Redis), are
-- store/fan_in_rules.py's RULES: a rule changed here is changed there too;
-- tests/store/test_fan_in_rules.py runs every row of it on these scripts.
--
-- Returns {status, policy}:
--   "released"       the parent is now pending (the host dispatches it)
--   "credited"       counted; the parent still waits, or no longer waits
--   "parent_failed"  policy fail, or the last child settled with children failed under
--                    fail_at_end: the parent is failed (the host records FAILURE for it;
--                    the row's 'failed_child' names the child that failed it)
local function fail_parent(parent, child_id, data, ttl)
  -- complete.lua's parent names neither its queue's failed set nor its :ignored (a success
  -- that settles a flow failed under fail_at_end fails it): the failed set is the pending
  -- set's sibling, :ignored the row's, both on the same slot.
  local failed = parent.failed or failed_set_of(parent.pending)
  local keys = flow_keys(parent)
  if not parent.ignored then
    table.insert(keys, ignored_of(parent.row))
  end
  redis.call('HSET', parent.row, 'state', 'failed', 'failed_child', child_id,
    'error', 'child ' .. child_id .. ' failed: ' .. data)
  redis.call('ZADD', failed, now_ms(), parent.id)
  redis.call('HINCRBY', parent.counters, 'held', -1)
  expire_keys(ttl, keys)
end

-- fail_at_end(parent, ttl): the last child settled and children failed under fail_at_end:
-- the parent fails with the first of them still failed.
local function fail_at_end(parent, ttl)
  local child_id = redis.call('HGET', parent.row, 'late_child')
  local data = child_id and redis.call('HGET', parent.row, 'failed:' .. child_id)
  if not data then
    -- A retry took the first back (retry_counted.lua, retry_flow.lua): any still failed.
    local cursor = '0'
    repeat
      local page = redis.call('HSCAN', failures_of(parent.row), cursor, 'COUNT', 100)
      cursor = page[1]
      for i = 1, #page[2], 2 do
        if not data and page[2][i + 1] == 'late' then
          child_id = page[2][i]
          data = redis.call('HGET', parent.row, 'failed:' .. child_id)
        end
      end
    until data or cursor == '0'
  end
  fail_parent(parent, child_id or '?', data or '', ttl)
end

local function settle_child(parent, child_id, outcome, data, policy, ttl)
  if (parent.quorum or '') ~= '' then
    return settle_quorum(parent, child_id, outcome, data, policy, ttl)
  end
  local state, late
  if outcome == 'done' then
    policy = ''
    -- What a success reads of its parent, in one command: its state and whether children
    -- failed under fail_at_end (the last to settle fails it, below).
    local row = redis.call('HMGET', parent.row, 'state', 'late_failed')
    state, late = row[1], tonumber(row[2] or '0') > 0
    if not state then
      return {'credited', policy} -- a flow that is gone (see settled_late)
    end
    redis.call('HSET', parent.processed, child_id, data)
    if parent.acc then
      -- Its value folded by the flow's reducer (includes/reduce.lua): once, as it is credited.
      redis.call('HSET', parent.row, 'acc', parent.acc)
    end
  else
    policy, state = record_failed(parent, child_id, data, policy)
    if policy == 'fail' then
      if state ~= 'awaiting_children' then
        return {'credited', policy}
      end
      fail_parent(parent, child_id, data, ttl)
      return {'parent_failed', policy}
    end
    if not state then
      return {'credited', policy} -- a flow that is gone (see settled_late)
    end
    if policy == 'ignore' then
      redis.call('HSET', parent.ignored, child_id, data)
    end
    if policy == 'fail_at_end' then
      redis.call('HINCRBY', parent.row, 'late_failed', 1)
      redis.call('HSETNX', parent.row, 'late_child', child_id)
    end
    late = tonumber(redis.call('HGET', parent.row, 'late_failed') or '0') > 0
  end
  local left = redis.call('DECR', parent.deps)
  if outcome ~= 'done' then
    -- A failed child counted as resolved. A child's value needs no count of its own: the
    -- parent's :processed has one field per credited child (HLEN), which spares every
    -- succeeding child a command.
    redis.call('HINCRBY', parent.row, 'credited_failed', 1)
  end
  if (policy == 'continue' or left <= 0) and state == 'awaiting_children' then
    if late then
      fail_at_end(parent, ttl) -- a failure it waited to give wins over a release
      return {'parent_failed', policy}
    end
    release_parent(parent.row, parent.pending, parent.id, parent.counters)
    if parent.settled then
      redis.call('EXPIRE', parent.settled, ttl)
    end
    return {'released', policy}
  end
  settled_late(parent, state, ttl)
  return {'credited', policy}
end
