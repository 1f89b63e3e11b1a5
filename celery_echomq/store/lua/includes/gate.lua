-- gate_ids(first, last, step, values): the id gate, run before any write. Every values[i]
-- (``values``: ARGV where not given, or a table a packed argument gave) for
-- i = first, first + step, ... last must be a job id: a JOB id, or a uuid in Celery's own
-- form (lower-case hex, 8-4-4-4-12), whose row the host names 'JOB' .. uuid; returns the
-- EMQKIND error reply for the first that is neither, else nil. The host's keyspace gate
-- already refused such ids: this keeps a script called by any other client from writing
-- outside the JOB namespace.
-- The pattern of 8-4-4-4-12 lower-case hex digits, written out: a literal is a constant of the
-- compiled script, where a pattern built with string.rep and '..' would be built again on
-- every call of every script.
local CELERY_UUID =
  '^[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$'
local function gate_ids(first, last, step, values)
  values = values or ARGV
  for i = first, last, step or 1 do
    local id = values[i]
    -- (a packed argument may give another type than a string)
    if type(id) ~= 'string'
        or (string.sub(id, 1, 3) ~= 'JOB' and not string.find(id, CELERY_UUID)) then
      return redis.error_reply('EMQKIND job id must be JOB-namespaced or a Celery uuid')
    end
  end
  return nil
end
