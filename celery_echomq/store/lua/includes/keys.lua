-- The one place a script names a key it was not passed: every other key is in its KEYS.
-- Each is derived from a declared key by its form in store/keyspace.py (one method of
-- Keyspace per suffix: Keyspace.<suffix>_key), so it shares that key's hash tag, and its
-- slot: Redis Cluster runs the script, though the key is not declared. A script derives one
-- only where the host cannot know it (a key that exists only on some rows, an index of a
-- flow's, a row whose id is known only inside the script).
--
-- A row's own keys, '<row>:<suffix>' (``row``: a job's row key):
--   :children  a parent's children's ids by position (a list; the operators' pages)
--   :failures  a parent's children failed under fail, remove, continue or fail_at_end
--   :ignored   a parent's errors of the children failed under ignore
--   :quorum    a parent's successes in order, under a quorum
--   :window    a windowed parent's children waiting for a slot (a list), and :slots beside it
--   :slots     its window's freed slots and its batch (a hash)
--   :parents   a job's parents it was joined to after its first (on_exists="join")

-- row_of(id): the row id that names a gated job id's keys, as store/keyspace.py's row_id: a
-- JOB id as it is, a Celery uuid as 'JOB' .. uuid. Only for ids gate_ids let through.
local function row_of(id)
  if string.sub(id, 1, 3) == 'JOB' then
    return id
  end
  return 'JOB' .. id
end

local function children_of(row)
  return row .. ':children'
end

local function failures_of(row)
  return row .. ':failures'
end

local function ignored_of(row)
  return row .. ':ignored'
end

local function quorum_of(row)
  return row .. ':quorum'
end

local function window_of(row)
  return row .. ':window'
end

local function slots_of(row)
  return row .. ':slots'
end

local function parents_of(row)
  return row .. ':parents'
end

-- row_of_dependencies(key): the row whose ':dependencies' ``key`` is, nil for any other key.
local function row_of_dependencies(key)
  if string.sub(key, -13) == ':dependencies' then
    return string.sub(key, 1, -14)
  end
  return nil
end

-- slots_of_window(window): the ':slots' beside a '<parent row>:window'.
local function slots_of_window(window)
  return slots_of(string.sub(window, 1, -8))
end

-- row_beside(key, id): the row of job ``id`` on the slot of ``key`` (a key of that queue:
-- its hash tag '<prefix>:{queue}:'): a waiting child its window lets out, a chain's next step.
local function row_beside(key, id)
  return string.match(key, '^(.-}:)') .. row_of(id)
end

-- failed_set_of(pending): the queue's failed set beside its pending set.
local function failed_set_of(pending)
  return (string.gsub(pending, ':pending$', ':failed'))
end

-- The check across queues of a store of one server (includes/taken.lua), from the parts the
-- host passes (Keyspace.check_parts): job ``id``'s row on ``queue``, and its claim.
local function row_on(parts, queue, id)
  return parts[1] .. queue .. parts[2] .. row_of(id)
end

local function claim_of(parts, id)
  return parts[3] .. row_of(id) .. parts[4]
end
