-- enqueue_flow: hold a parent and make its N children claimable, in one atomic step on one slot.
-- Two guards keep bad input from writing anything: no row of the flow may already exist,
-- and an empty flow's parent is released at once.
--
-- KEYS[1]      the parent row                  emq:{q}:JOBp
-- KEYS[2]      the outstanding-child counter   emq:{q}:JOBp:dependencies
-- KEYS[3]      the queue's pending set         emq:{q}:pending
-- KEYS[4]      the queue's recent-flow index   emq:{q}:recent
-- KEYS[5]      the queue's counters            emq:{q}:counters
-- KEYS[5+i]    child i's row, i = 1..N         emq:{q}:JOBc
-- KEYS[6+N]    optional (with the option locator_ttl): the parent's locator   emq:loc:{JOBp}
-- KEYS[...]    optional (with the option register or check): the registry of queues that
--              hold flows emq:queues (after the locator when both are given)
-- KEYS[...]    optional (with the option broker_db): the broker's lists the children's
--              messages go to, after the keys above
--              (these live on other slots than the queue's: never passed on a Cluster)
-- ARGV[1]      parent id
-- ARGV[2]      parent payload
-- ARGV[3]      N, the number of children
-- ARGV[4]      the children, packed (msgpack): an array of 2N strings, child i's id at 2i-1 and
--              its stored job at 2i: its payload, or its delta (see the option kinds)
-- ARGV[5]      how long, in ms, a flow stays in the recent index (the result TTL)
-- ARGV[6]      the most flows the recent index keeps
-- ARGV[7]      optional ('' or absent: none): the options, packed (a msgpack map), each one
--              absent where not given:
--   outer      the outer flow's parent id when this flow is nested in another
--   template   the template the children's deltas are stored against, kept on the parent's row
--   kinds      one character per child, 'd' where its stored job is a delta (the row keeps it
--              as 'delta' rather than 'payload': a small row stays a listpack), 'p' where it
--              is a whole payload (absent: every child's is a payload);
--              's', 'w', 'l' for the first, a middle and the last step of a linked chain, in
--              order (includes/chain_step.lua: only its last is counted, only its first pending)
--              'D', 'P' for a child waiting for a slot of the flow's window, as a delta or a
--              payload (includes/window.lua: counted, not pending, its id in '<parent row>:window');
--              'e', 'q' for a child of a flow with a window that goes out at once, as a delta or
--              a payload (written as 'd' and 'p' are, marked 'windowed': it holds a slot)
--   policy     the flow's policy, kept on the parent's row (absent: none, which reads as 'fail')
--   locator_ttl  the locator's TTL in seconds: KEYS[6+N] is set to the queue's name with it
--              (absent: no locator written here)
--   queue      the queue's name (with locator_ttl or check)
--   register   an array of queue names to add to the registry (every queue of the flow's tree,
--              so that recovery looks there; they land with the flow)
--   check      an array of the four key parts of the check across queues, on a store of one
--              server (includes/taken.lua): a row's head and tail around its queue, a claim's
--              head and tail around its id (absent: no check, the host made it)
--   broker_db  the broker's database, on this same server: the children's messages are
--              pushed there in this step (absent: the host publishes them)
--   messages   with it, an array of triples, one after another: the 1-based index of a
--              message's list among the broker's KEYS, the message up to its enqueue time and
--              the rest after it (the message is head .. now .. tail, so it carries the time
--              this step read)
--
-- Reply: {the counter (N, less the steps of chains before their last), now}: now is the server time in ms this script read, the score of
-- every child in the pending set (so recovery can tell how long a job has waited).
-- A refusal returns before any write, and before any message is pushed.
-- Errors (nothing written): "EMQKIND ..." a non-JOB id; "EMQEXISTS <id>" a row already exists;
-- "EMQEXISTS <id> <queue>" the id is another queue's (its row, or its enqueue in flight);
-- "EMQWIDE ..." the check across queues is too wide for one script: the host makes it.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local parent_key = KEYS[1]
local deps_key = KEYS[2]
local pending_key = KEYS[3]
local recent_key = KEYS[4]
local counters_key = KEYS[5]
local children_at = 5 -- child i's row is KEYS[children_at + i], the optional keys after them
--- @include "gate"
--- @include "keys"
--- @include "recent"
--- @include "child_row"
--- @include "taken"
--- @include "chain_step"
--- @include "window"

-- The packed arguments: a table each (iterated, never unpack()ed whole: Lua's stack holds
-- some thousands of values).
local n = tonumber(ARGV[3])
local children = cmsgpack.unpack(ARGV[4])
local options = {}
if (ARGV[7] or '') ~= '' then
  options = cmsgpack.unpack(ARGV[7])
end
-- The id gate runs FIRST over the parent and every child id: a non-JOB id refuses before any
-- write.
local refused = gate_ids(1, 1) or gate_ids(1, 2 * n - 1, 2, children)
if refused then
  return refused
end
-- Never overwrite: a parent or child row that exists belongs to another flow (or this one, sent twice).
-- The one exception is a nested flow's parent: its outer flow wrote it as a pending child that
-- no worker has claimed, carrying the outer parent id this call names. It becomes held here.
local outer = options.outer or ''
-- A top-level flow (no outer) has no placeholder to find: the parent row and counter join the
-- first slice's variadic EXISTS below, and their own reads are skipped (two commands a flow).
local placeholder = {}
if outer ~= '' then
  if redis.call('EXISTS', deps_key) > 0 then
    return redis.error_reply('EMQEXISTS ' .. ARGV[1])
  end
  placeholder = redis.call('HMGET', parent_key, 'state', 'parent', 'attempts', 'format')
  refused = newer_format(placeholder[4], parent_key)
  if refused then
    return refused
  end
elseif n == 0 and redis.call('EXISTS', parent_key, deps_key) > 0 then
  return redis.error_reply('EMQEXISTS ' .. ARGV[1])
end
if placeholder[1] then
  if outer == '' or placeholder[1] ~= 'pending' or placeholder[2] ~= outer
      or placeholder[3] ~= '0' then
    return redis.error_reply('EMQEXISTS ' .. ARGV[1])
  end
end
-- One variadic EXISTS per slice of rows (Lua's unpack has a stack limit); look for the
-- offender only on a hit.
local SLICE = 500
for first = children_at + 1, children_at + n, SLICE do
  local last = math.min(first + SLICE - 1, children_at + n)
  local found
  if first == children_at + 1 and outer == '' then
    found = redis.call('EXISTS', parent_key, deps_key, unpack(KEYS, first, last))
    if found > 0 and redis.call('EXISTS', parent_key, deps_key) > 0 then
      return redis.error_reply('EMQEXISTS ' .. ARGV[1])
    end
  else
    found = redis.call('EXISTS', unpack(KEYS, first, last))
  end
  if found > 0 then
    for i = first, last do
      if redis.call('EXISTS', KEYS[i]) > 0 then
        return redis.error_reply('EMQEXISTS ' .. children[2 * i - 11])
      end
    end
  end
end
-- The same ids on every other queue, before any write (a store of one server only).
local register = options.register or {}
local check = options.check
local locator_ttl = options.locator_ttl
local extra = children_at + n + 1 -- the first of the optional KEYS
if locator_ttl then
  extra = extra + 1 -- after the locator
end
if check then
  local ids = {}
  if outer == '' then
    ids[1] = ARGV[1]
  end
  for i = 1, n do
    ids[#ids + 1] = children[2 * i - 1]
  end
  local taken = taken_elsewhere(KEYS[extra], check, options.queue, ids)
  if taken then
    return taken
  end
end
-- One clock reading for the pending scores and the recent index.
local now = now_ms()
-- Each child: its row claimable (state pending), carrying the parent id, and in the pending
-- set (one variadic ZADD per slice).
local template = options.template or ''
local kinds = options.kinds or ''
local members = {}
-- The parent's index of its children by position: the list '<its row>:children' (named
-- from KEYS[1], on its slot; it expires with the flow's :dependencies, see 'expire'). What an
-- operator's page of children reads (LRANGE of a page), never the payload's whole list. One
-- RPUSH per slice. A linked chain is listed once, by its last step (the child its parent
-- counts).
local index_key = children_of(parent_key)
local index = {}
-- The children the parent counts: every child, but the steps of a chain before its last.
local counted, head, head_at = 0, '', 0
-- The children waiting for a slot of the flow's window, in order.
local waiting = {}
local function id_at(i)
  return children[2 * i - 1]
end
for i = 1, n do
  local child = KEYS[children_at + i]
  local cid, stored = children[2 * i - 1], children[2 * i]
  local kind = string.byte(kinds, i)
  local pending = true
  local listed = true
  if is_step(kind) then
    if kind == STEP_FIRST then
      head, head_at = cid, i
    end
    pending = write_step_row(child, ARGV[1], stored, kind, head, children[2 * i + 1],
      kind == STEP_LAST and step_ids(head_at, i, id_at) or nil)
    listed = kind == STEP_LAST
    if listed then
      counted = counted + 1
    end
  elseif is_waiting(kind) then
    write_waiting_row(child, ARGV[1], stored, kind)
    waiting[#waiting + 1] = cid
    pending = false
    counted = counted + 1
  else
    write_child_row(child, ARGV[1], stored, is_delta_out(kind),
      is_windowed_out(kind))
    counted = counted + 1
  end
  if pending then
    members[#members + 1] = now_text() -- a string: see includes/now_ms.lua
    members[#members + 1] = cid
  end
  if listed then
    index[#index + 1] = cid
  end
  if #members >= 2 * SLICE or (i == n and #members > 0) then
    redis.call('ZADD', pending_key, unpack(members))
    members = {}
  end
  if #index >= SLICE or (i == n and #index > 0) then
    redis.call('RPUSH', index_key, unpack(index))
    index = {}
  end
end
if #waiting > 0 then
  -- the window's size: those out
  window_push(window_of(parent_key), waiting, counted - #waiting, counters_key)
end
if placeholder[1] then
  redis.call('ZREM', pending_key, ARGV[1])
end
-- The parent: held out of pending (awaiting_children, in NO state set, so no claim reaches it)
-- and the counter set to N. With no children there is nothing to wait for: release it now.
local policy = options.policy or ''
if counted == 0 then
  redis.call('HSET', parent_key, 'state', 'pending', 'attempts', '0', 'payload', ARGV[2],
    'format', STORE_FORMAT_TEXT)
  redis.call('ZADD', pending_key, now_text(), ARGV[1])
  redis.call('HINCRBY', counters_key, 'released', '1')
else
  -- The row in one HSET: its template and policy, where given, with its state.
  local row = {'state', 'awaiting_children', 'attempts', '0', 'payload', ARGV[2],
    'format', STORE_FORMAT_TEXT}
  if template ~= '' then
    row[#row + 1], row[#row + 2] = 'template', template
  end
  if policy ~= '' then
    row[#row + 1], row[#row + 2] = 'policy', policy
  end
  redis.call('HSET', parent_key, unpack(row))
  redis.call('HINCRBY', counters_key, 'held', '1')
end
redis.call('SET', deps_key, string.format('%d', counted))
if counted == 0 and policy ~= '' then
  redis.call('HSET', parent_key, 'policy', policy)
end
-- Where a bare id lives, and where recovery looks: written with the flow, so a producer that
-- dies after this script leaves neither missing, and a refused flow leaves neither behind.
if locator_ttl then
  redis.call('SET', KEYS[children_at + n + 1], options.queue, 'EX', locator_ttl)
end
if #register > 0 then
  redis.call('SADD', KEYS[extra], unpack(register))
end
if #register > 0 or check then
  extra = extra + 1 -- after the registry
end
index_recent(recent_key, ARGV[1], tonumber(ARGV[5]), tonumber(ARGV[6]))
-- The children's messages, when the broker is a database of this server: the flow lands with
-- its messages or not at all, in one round trip. Each list's messages in one LPUSH per slice,
-- in the order given (what the host's own pipeline would push).
local broker_db = options.broker_db
if broker_db then
  local stamp = string.format('%d', now)
  local lists, order = {}, {}
  local given = options.messages or {}
  for i = 1, #given, 3 do
    local key = KEYS[extra - 1 + given[i]]
    if not lists[key] then
      lists[key] = {}
      order[#order + 1] = key
    end
    local messages = lists[key]
    messages[#messages + 1] = given[i + 1] .. stamp .. given[i + 2]
  end
  redis.call('SELECT', tonumber(broker_db))
  for _, key in ipairs(order) do
    local messages = lists[key]
    for first = 1, #messages, SLICE do
      redis.call('LPUSH', key, unpack(messages, first, math.min(first + SLICE - 1, #messages)))
    end
  end
end
return {counted, now}
