-- take_handed: a delivery takes a chain's step that the completion of the step before handed
-- out (complete.lua): active with no token -> active under the delivery's token, as a claim
-- would have left it, in two commands where claim runs six. Atomic, so that a forged message
-- naming another parent can never hold the token, even for a moment, while the real delivery
-- looks (it would find the step busy and take nothing).
--
-- KEYS[1]  the step's row
-- ARGV[1]  the step's id
-- ARGV[2]  the delivery's token
-- ARGV[3]  the parent id the delivery's message names: the row's own 'parent' must be it
--
-- Reply: {status}
--   "claimed"  the step was active with no token and names that parent: it now holds the
--              token (also for a call resent through a failover, which finds its own token)
--   "noop"     anything else (taken by another delivery, pending, finished, forged, gone):
--              nothing changed; the caller claims as for any delivery
-- Errors (nothing written): "EMQKIND ..." a non-JOB id.
-- "EMQFORMAT <found> <known> <row>" a row of a newer store format (includes/format.lua).
local job_key = KEYS[1]
--- @include "gate"
--- @include "format"
local refused = gate_ids(1, 1)
if refused then
  return refused
end
local row = redis.call('HMGET', job_key, 'state', 'token', 'parent', 'format')
refused = newer_format(row[4], job_key)
if refused then
  return refused
end
if row[1] ~= 'active' or row[3] ~= ARGV[3] then
  return {'noop'}
end
if row[2] then
  return {row[2] == ARGV[2] and 'claimed' or 'noop'}
end
redis.call('HSET', job_key, 'token', ARGV[2])
return {'claimed'}
