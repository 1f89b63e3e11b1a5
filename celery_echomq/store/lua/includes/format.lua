-- The store's format (store/store_format.py's STORE_FORMAT, written in by store/loader.py):
-- the rows a script creates carry it as their 'format' field; a row without one was written
-- before formats were recorded (format 1, read and finished as it is).
local STORE_FORMAT = tonumber('@STORE_FORMAT@')
-- The same, as the string a script writes into a row's 'format' (a Lua number passed to
-- redis.call is printed with '%.17g' on every call: one a child on the enqueue's path).
local STORE_FORMAT_TEXT = '@STORE_FORMAT@'

-- newer_format(found, row): the EMQFORMAT error reply when ``found`` (a row's 'format' field,
-- nil for none) is newer than this release knows, else nil. Every writing script runs it on
-- each row it writes before its first write, reading the field in an HMGET it makes anyway
-- where it has one: a newer release's row is never written by an older one.
local function newer_format(found, row)
  if found and (tonumber(found) or STORE_FORMAT + 1) > STORE_FORMAT then
    return redis.error_reply('EMQFORMAT ' .. found .. ' ' .. STORE_FORMAT .. ' ' .. row)
  end
  return nil
end

-- newer_rows(keys, first, last): newer_format over the rows keys[first..last], one HGET each:
-- for the scripts that read nothing else of a row before writing it (none of a flow's hot path).
local function newer_rows(keys, first, last)
  for i = first, last or first do
    local refused = newer_format(redis.call('HGET', keys[i], 'format'), keys[i])
    if refused then
      return refused
    end
  end
  return nil
end
