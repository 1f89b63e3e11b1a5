--- @include "now_ms"
--- @include "format"
--- @include "keys"
-- A window on a flow's children (flow(..., max_active=N)): at most N of them published or
-- running at once. The others are rows 'waiting' (in no state set: nothing claims them, and
-- they have no message), their ids in the children's order in the list '<parent row>:window'
-- on their own slot. The script that finishes a child (complete, fail) makes the next one
-- pending and hands it to its caller to publish, in the same step: a slot freed is a slot
-- taken, so no more than N are ever out. A crash before the publish leaves a pending row
-- without a message, which recovery re-publishes as any other.
--
-- A waiting child's kind (enqueue_flow, add_children): 'D' stored as a delta against its
-- flow's template, 'P' as a whole payload (a nested flow's entry, a child of another slot).
-- A child of a flow with a window that goes out at once: 'e' a delta, 'q' a whole payload,
-- written as 'd' and 'p' are, with the mark 'windowed' (includes/child_row.lua).
local WAIT_DELTA, WAIT_PAYLOAD = 68, 80
local OUT_DELTA, OUT_PAYLOAD = 101, 113

local function is_waiting(kind)
  return kind == WAIT_DELTA or kind == WAIT_PAYLOAD
end

local function is_windowed_out(kind)
  return kind == OUT_DELTA or kind == OUT_PAYLOAD
end

-- Whether a child of ``kind`` going out at once is stored as a delta: 'd' or 'e'.
local function is_delta_out(kind)
  return kind == 100 or kind == OUT_DELTA
end

-- write_waiting_row(row, parent_id, stored, kind): a child that waits for a slot: the fields
-- of write_child_row's pending row but its attempts and its mark 'windowed' (none yet, as a
-- missing field reads; both written when it goes out, window_take), so that every reader
-- (show, cancel, a deadline, recovery once it is pending) finds one layout; 'waiting' tells
-- it apart. A million of them wait in a window: each field it does without is a few bytes a
-- child.
local function write_waiting_row(row, parent_id, stored, kind)
  redis.call('HSET', row, 'state', 'waiting', kind == WAIT_DELTA and 'delta' or 'payload', stored,
    'parent', parent_id, 'format', STORE_FORMAT_TEXT)
end

-- window_push(window, ids, size, counters): the waiting children's ids at the end of the
-- window, in order, one RPUSH per slice (Lua's unpack has a stack limit); and the window's
-- '<parent row>:slots' (a hash beside it: 'free', the slots freed and not taken again yet;
-- 'batch', how many freed slots are taken at once), kept while children wait. The rows of
-- ``ids`` were written 'waiting' by this same script (none existed before): the queue's
-- count of children waiting in windows, 'window_waiting' in ``counters`` (its counters
-- hash), goes up by as many. Every way out of 'waiting' counts one down: window_take here,
-- includes/unwait.lua elsewhere.

-- How many freed slots are taken at once: a tenth of the window (at most 100), so that a
-- worker publishes the next children in batches, not one message per child, and the window
-- stays at least nine tenths full; every slot at once for a window of under 20.
local function window_batch(size)
  return math.max(1, math.min(100, math.floor(size / 10)))
end

local function window_push(window, ids, size, counters)
  redis.call('HINCRBY', counters, 'window_waiting', #ids)
  for first = 1, #ids, 500 do
    redis.call('RPUSH', window, unpack(ids, first, math.min(first + 499, #ids)))
  end
  local slots = slots_of_window(window)
  redis.call('HSET', slots, 'batch', window_batch(size))
  redis.call('PERSIST', slots)
end

-- A waiting row that left 'waiting' by another way than this window (revoked by its id) is
-- passed over; at most this many in one step, so that no step runs long.
local PASS_OVER = 100

-- window_take(window, pending, count, taken): up to ``count`` waiting children made pending
-- (their ids into the queue's pending set), in order, appended to ``taken`` as id, payload,
-- delta, parent (one of payload and delta ''); how many (the caller counts them out of
-- 'window_waiting'). A cancelled one means the flow's
-- waiting children were cancelled or cut together (cancel, a deadline): the window goes.
local function window_take(window, pending, count, taken)
  local n, members = 0, {}
  for _ = 1, count + PASS_OVER do
    if n == count then
      break
    end
    local id = redis.call('LPOP', window)
    if not id then
      break
    end
    local row = row_beside(window, id) -- on the window's own slot
    local found = redis.call('HMGET', row, 'state', 'payload', 'delta', 'parent')
    if found[1] == 'waiting' then
      redis.call('HSET', row, 'state', 'pending', 'attempts', '0', 'windowed', '1')
      members[#members + 1] = now_text()
      members[#members + 1] = id
      if #members == 1000 then -- one ZADD per slice of 500 (Lua's unpack has a stack limit)
        redis.call('ZADD', pending, unpack(members))
        members = {}
      end
      taken[#taken + 1] = id
      taken[#taken + 1] = found[2] or ''
      taken[#taken + 1] = found[3] or ''
      taken[#taken + 1] = found[4] or ''
      n = n + 1
    elseif found[1] == 'cancelled' then
      redis.call('DEL', window)
      break
    end
  end
  if #members > 0 then
    redis.call('ZADD', pending, unpack(members))
  end
  return n
end

-- window_free(window, pending, ttl, counters): a child of the window finished: its slot is
-- free. Once 'batch' slots are free, that many waiting children are made pending at once (and
-- counted out of 'window_waiting' in ``counters``, their queue's counters), returned as
-- {'window', now, id, payload, delta, parent, ...} for the caller to publish in one batch
-- (out + free = max_active: never more out, and the window never stalls, batch <= max_active);
-- nil otherwise. Called only for a child marked 'windowed' (a flow without a window has none).
local function window_free(window, pending, ttl, counters)
  local slots = slots_of_window(window)
  local batch = redis.call('HGET', slots, 'batch')
  if not batch then
    return nil
  end
  local free = redis.call('HINCRBY', slots, 'free', '1')
  if free < tonumber(batch) then
    return nil
  end
  local taken = {'window', now_ms()}
  local n = window_take(window, pending, free, taken)
  if n > 0 then -- (never -0: Redis reads no integer in it)
    local out = string.format('%d', -n)
    redis.call('HINCRBY', slots, 'free', out)
    redis.call('HINCRBY', counters, 'window_waiting', out)
  end
  if redis.call('EXISTS', window) == 0 then
    -- Nothing waits any more (children added later open it again): it goes with the flow.
    redis.call('EXPIRE', slots, ttl)
  end
  return n > 0 and taken or nil
end

-- window_reply(reply, window, pending, counters, ttl): ``reply`` with the children the window
-- let out appended, as a list of its own (the last element: no other element of a reply is a
-- list), when the finished child held a slot of ``window`` (its queue's ``pending`` set and
-- ``counters`` beside it). ``window`` nil: ``reply`` as it is. Called once per child that
-- finishes, inside its one transition.
local function window_reply(reply, window, pending, counters, ttl)
  if not window then
    return reply
  end
  local taken = window_free(window, pending, ttl, counters)
  if taken then
    reply[#reply + 1] = taken
  end
  return reply
end

-- window_room(size, deps, window, wanted): how many (of ``wanted``) children added to a running flow (grow_flow) may
-- go out now: its free slots, or where it has none yet, its window's size less the children
-- out (its outstanding ones, ``deps``, less those waiting). Those are taken here.
local function window_room(size, deps, window, wanted)
  local slots = slots_of_window(window)
  local free = redis.call('HGET', slots, 'free')
  if free then
    local room = math.min(wanted, math.max(0, tonumber(free)))
    if room > 0 then
      redis.call('HINCRBY', slots, 'free', -room)
    end
    return room
  end
  local out = (tonumber(redis.call('GET', deps)) or 0) - redis.call('LLEN', window)
  return math.min(wanted, math.max(0, size - out))
end
