--- @include "keys"
-- taken_elsewhere(registry, parts, own, ids): an id names one job in the whole store. On a
-- store of one server, where a script may read any key, the enqueue that writes ``ids`` on
-- queue ``own`` checks them against every queue at once, atomically with its writes: a
-- claim of another queue's enqueue in flight (``parts[3] .. id .. parts[4]``, set by the
-- host's claim step, see send/ids.py), or a row on any queue of the registry but ``own``
-- (``parts[1] .. queue .. parts[2] .. id``). ``parts`` come from store/keyspace.py, the
-- only place a key's form is written. Returns the EMQEXISTS error reply for the first id
-- taken, else nil. One SMEMBERS, then one variadic EXISTS per slice of keys: a key per id
-- for the claims, and one per id and other queue (none on a store of one queue).
-- The rows of other queues are looked up here when there are at most CHECK_QUEUES of them
-- (a few keys per id, of the order of what the script writes per child, however large the
-- flow), or at most CHECK_MAX keys in all. A wider check would hold the server for
-- milliseconds: before any lookup, "EMQWIDE" tells the host to claim the ids and check them
-- itself (send/ids.py), then call again without the check.
local CHECK_MAX = 1000
local CHECK_QUEUES = 4
-- The first i whose keys[i] exists and, when ``value`` is given, holds another value than it.
local function _first_taken(keys, value)
  local SLICE_IDS = 500
  for first = 1, #keys, SLICE_IDS do
    local last = math.min(first + SLICE_IDS - 1, #keys)
    if redis.call('EXISTS', unpack(keys, first, last)) > 0 then
      for i = first, last do
        if value == nil then
          if redis.call('EXISTS', keys[i]) > 0 then
            return i, nil
          end
        else
          local held = redis.call('GET', keys[i])
          if held and held ~= value then
            return i, held
          end
        end
      end
    end
  end
  return nil, nil
end

local function taken_elsewhere(registry, parts, own, ids)
  if #ids == 0 then
    return nil
  end
  local others = {}
  for _, queue in ipairs(redis.call('SMEMBERS', registry)) do
    if queue ~= own then
      others[#others + 1] = queue
    end
  end
  if #others > CHECK_QUEUES and #others * #ids > CHECK_MAX then
    return redis.error_reply('EMQWIDE ' .. #ids .. ' ids x ' .. #others .. ' queues')
  end
  local claims = {}
  for i = 1, #ids do
    claims[i] = claim_of(parts, ids[i])
  end
  local hit, queue = _first_taken(claims, own)
  if hit then
    return redis.error_reply('EMQEXISTS ' .. ids[hit] .. ' ' .. queue)
  end
  for _, other in ipairs(others) do
    local rows = {}
    for i = 1, #ids do
      rows[i] = row_on(parts, other, ids[i])
    end
    hit = _first_taken(rows, nil)
    if hit then
      return redis.error_reply('EMQEXISTS ' .. ids[hit] .. ' ' .. other)
    end
  end
  return nil
end
