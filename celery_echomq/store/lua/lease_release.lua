-- lease_release: give up the recovery lease only if this holder still has it (compare and
-- delete), so a pass that outlived its lease never deletes the next holder's.
-- (The lease is taken with a plain SET key token NX PX ms.)
--
-- KEYS[1]  the lease key
-- ARGV[1]  the holder's token
--
-- Reply: 1 released; 0 not held by this token (expired, or another holder's): nothing changed.
local lease_key = KEYS[1]
if redis.call('GET', lease_key) == ARGV[1] then
  return redis.call('DEL', lease_key)
end
return 0
