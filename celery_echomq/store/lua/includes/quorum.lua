--- @include "expire"
--- @include "now_ms"
--- @include "release_parent"
--- @include "keys"
-- flow_keys(parent): the flow's keys that expire with its row once it is finished (those of
-- ``parent`` that its caller passed: complete passes no :ignored and no :settled).
local function flow_keys(parent)
  local keys = {parent.row, parent.deps, parent.processed}
  if parent.ignored then
    table.insert(keys, parent.ignored)
  end
  if parent.settled then
    table.insert(keys, parent.settled)
  end
  return keys
end

-- settled_late(parent, state, ttl): a child that settles after its flow finished (a child
-- still running when a sibling failed it, or when it was cancelled) is recorded as ever, and
-- what it wrote expires with the flow: a key it made anew (the flow's first value in
-- :processed, say) would otherwise never expire. A flow whose row is gone (expired or
-- forgotten; ``state`` nil) is never written to at all: its callers return before.
local finished = {failed = true, cancelled = true, done = true}
local function settled_late(parent, state, ttl)
  if finished[state] then
    expire_keys(ttl, flow_keys(parent))
  end
end

-- record_failed(parent, child_id, data, policy): what the flow keeps of a child failed for
-- good, whatever its policy: the queue's count of failures per policy, and under ignore the
-- error in :ignored (the caller writes it), under the others the parent row's field
-- 'failed:<child id>' (with 'failed_children' counting them, and '<row>:failures'). Returns
-- the policy ('' read as the flow's default) and the parent's state (nil: the row is gone).
local function record_failed(parent, child_id, data, policy)
  if policy == '' then
    policy = redis.call('HGET', parent.row, 'policy') or 'fail'
  end
  -- One command per failed child, none per completed one.
  redis.call('HINCRBY', parent.counters, 'failed_' .. policy, 1)
  local found = redis.call('HGET', parent.row, 'state')
  -- Not on a row that is gone (an expired or forgotten flow): that would leave a row behind.
  if found and policy ~= 'ignore'
      and redis.call('HSET', parent.row, 'failed:' .. child_id, data) == 1 then
    redis.call('HINCRBY', parent.row, 'failed_children', 1)
    -- The same ids in a hash of their own, '<row>:failures' (id -> 1; named from the row,
    -- on its slot, expiring with the flow: see 'expire'): a page of failed children is an
    -- HSCAN of it, never of the row, whose payload a huge flow's scan would copy.
    -- A child failed under fail_at_end is marked 'late': a retry counts it back, and the
    -- failure of the flow looks for one there (settle_child).
    redis.call('HSET', failures_of(parent.row), child_id,
      policy == 'fail_at_end' and 'late' or 1)
  end
  return policy, found
end

-- settle_quorum(parent, child_id, outcome, data, policy, ttl): settle_child for a flow
-- released by a quorum (flow(..., quorum=K)), parent.quorum "K/N". Each success credited while
-- the parent waits (or is failed, which a retry may undo) is kept in :processed, folded into
-- the row's 'acc' under a reducer (parent.acc), and its id appended to '<row>:quorum' (the order
-- of success, which the parent's values follow); the K-th releases the parent, here. A success after the release (a child already running) is
-- finished on its own row and not counted as a value: the row's 'cut_children' counts it,
-- with the children cut before they started (the flow ended without it). A failure,
-- whatever its policy but continue, is one child fewer that can succeed: when fewer than K can
-- still succeed the parent fails at once, its 'error' saying how many succeeded and how many
-- were needed; continue releases it at once, as without a quorum. Every settled child counts
-- its :dependencies down (what show and dependencies() read as outstanding).
-- Returns what settle_child returns.
local function settle_quorum(parent, child_id, outcome, data, policy, ttl)
  local need, total = string.match(parent.quorum, '^(%d+)/(%d+)$')
  need, total = tonumber(need), tonumber(total)
  local order = quorum_of(parent.row)
  if outcome == 'done' then
    local state = redis.call('HGET', parent.row, 'state')
    if state ~= 'awaiting_children' and state ~= 'failed' then
      if state then
        -- Its flow ended without it (its quorum met, or cancelled): counted as cut, as the
        -- children that never started are, not as a value.
        redis.call('HINCRBY', parent.row, 'cut_children', 1)
        redis.call('HINCRBY', parent.counters, 'children_cut', 1)
      end
      return {'credited', ''}
    end
    redis.call('HSET', parent.processed, child_id, data)
    if parent.acc then
      -- Its value folded by the flow's reducer (includes/reduce.lua): the parent gets the
      -- fold of the successes it counts, once each.
      redis.call('HSET', parent.row, 'acc', parent.acc)
    end
    redis.call('DECR', parent.deps)
    local succeeded = redis.call('RPUSH', order, child_id)
    if state == 'failed' then
      -- Counted for a retry (retry_flow.lua, retry_deadline.lua), which reads the quorum
      -- from the row: a flow failed by its deadline may meet it meanwhile.
      redis.call('HSET', parent.row, 'quorum', need)
      settled_late(parent, state, ttl)
      return {'credited', ''}
    end
    if succeeded < need then
      return {'credited', ''}
    end
    release_parent(parent.row, parent.pending, parent.id, parent.counters)
    if parent.settled then
      redis.call('EXPIRE', parent.settled, ttl)
    end
    return {'released', ''}
  end
  local found
  policy, found = record_failed(parent, child_id, data, policy)
  if not found then
    return {'credited', policy} -- a flow that is gone (see settled_late)
  end
  if policy == 'ignore' then
    redis.call('HSET', parent.ignored, child_id, data)
  end
  redis.call('DECR', parent.deps)
  redis.call('HINCRBY', parent.row, 'credited_failed', 1)
  if found ~= 'awaiting_children' then
    settled_late(parent, found, ttl)
    return {'credited', policy}
  end
  if policy == 'continue' then
    release_parent(parent.row, parent.pending, parent.id, parent.counters)
    if parent.settled then
      redis.call('EXPIRE', parent.settled, ttl)
    end
    return {'released', policy}
  end
  local failed = redis.call('HINCRBY', parent.row, 'quorum_failed', 1)
  redis.call('HSET', parent.row, 'quorum', need) -- what a retry (retry_flow.lua) reads
  if total - failed >= need then
    return {'credited', policy}
  end
  local succeeded = redis.call('LLEN', order)
  redis.call('HSET', parent.row, 'state', 'failed', 'failed_child', child_id, 'error',
    'quorum not met: ' .. succeeded .. ' of ' .. total .. ' children succeeded, ' .. need
    .. ' needed (' .. failed .. ' failed; the last, ' .. child_id .. ': ' .. data .. ')')
  redis.call('ZADD', parent.failed, now_ms(), parent.id)
  redis.call('HINCRBY', parent.counters, 'held', -1)
  expire_keys(ttl, flow_keys(parent))
  return {'parent_failed', policy}
end
