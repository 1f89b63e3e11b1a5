-- gate_ids(first, last, step): the id gate, run before any write. Every ARGV[i] for
-- i = first, first + step, ... last must be a JOB id; returns the EMQKIND error reply for the
-- first that is not, else nil. The host's keyspace gate already refused such ids: this keeps
-- a script called by any other client from writing outside the JOB namespace.
local function gate_ids(first, last, step)
  for i = first, last, step or 1 do
    if string.sub(ARGV[i], 1, 3) ~= 'JOB' then
      return redis.error_reply('EMQKIND job id must be JOB-namespaced')
    end
  end
  return nil
end
