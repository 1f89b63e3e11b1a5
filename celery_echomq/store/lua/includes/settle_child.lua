--- @include "expire"
--- @include "now_ms"
--- @include "release_parent"
--- @include "quorum"
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
-- Whatever the policy, the flow keeps what failed (failed_children() reads it): under ignore
-- in :ignored, under the others as the parent row's field 'failed:<child id>' (the error),
-- with 'failed_children' counting those fields, so that dependencies() can tell a child
-- failed under fail (never counted down) from one still outstanding. On the row, not in a
-- key of its own: it lives and expires with the flow, and no script takes one more key.
--
-- Returns {status, policy}:
--   "released"       the parent is now pending (the host dispatches it)
--   "credited"       counted; the parent still waits, or no longer waits
--   "parent_failed"  policy fail: the parent is failed (the host records FAILURE for it)
local function settle_child(parent, child_id, outcome, data, policy, ttl)
  if (parent.quorum or '') ~= '' then
    return settle_quorum(parent, child_id, outcome, data, policy, ttl)
  end
  local state
  if outcome == 'done' then
    policy = ''
    state = redis.call('HGET', parent.row, 'state')
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
      redis.call('HSET', parent.row, 'state', 'failed', 'failed_child', child_id,
        'error', 'child ' .. child_id .. ' failed: ' .. data)
      redis.call('ZADD', parent.failed, now_ms(), parent.id)
      redis.call('HINCRBY', parent.counters, 'held', -1)
      expire_keys(ttl, flow_keys(parent))
      return {'parent_failed', policy}
    end
    if not state then
      return {'credited', policy} -- a flow that is gone (see settled_late)
    end
    if policy == 'ignore' then
      redis.call('HSET', parent.ignored, child_id, data)
    end
  end
  local left = redis.call('DECR', parent.deps)
  if outcome ~= 'done' then
    -- A failed child counted as resolved. A child's value needs no count of its own: the
    -- parent's :processed has one field per credited child (HLEN), which spares every
    -- succeeding child a command.
    redis.call('HINCRBY', parent.row, 'credited_failed', 1)
  end
  if (policy == 'continue' or left <= 0) and state == 'awaiting_children' then
    release_parent(parent.row, parent.pending, parent.id, parent.counters)
    if parent.settled then
      redis.call('EXPIRE', parent.settled, ttl)
    end
    return {'released', policy}
  end
  settled_late(parent, state, ttl)
  return {'credited', policy}
end
