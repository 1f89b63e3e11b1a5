-- lease_release: give up the recovery lease only if this holder still has it (compare and
-- delete), so a pass that outlived its lease never deletes the next holder's.
-- (The lease is taken with a plain SET key token NX PX ms.)
--
-- KEYS[1]  the lease key
-- ARGV[1]  the holder's token
--
-- Reply: 1 released; 0 not held by this token (expired, or another holder's): nothing changed.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
