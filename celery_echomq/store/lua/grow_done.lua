-- grow_done: the last step of adding children of other slots to a held flow: add_children has
-- written their rows on their own slots, so they leave the parent's :adding (staged payloads)
-- and, once none is left, the parent leaves its queue's adding set. Run by the host right
-- after add_children, and by recovery for what a crash left staged.
--
-- KEYS[1]  the parent's :adding
-- KEYS[2]  the parent queue's adding set
-- ARGV[1]  parent id
-- ARGV[2..] the child ids whose rows were written
--
-- Reply: the number of children still staged for this parent.
-- Errors: "EMQKIND ..." a non-JOB id.
--- @include "gate"
local refused = gate_ids(1, #ARGV)
if refused then
  return refused
end
for i = 2, #ARGV do
  redis.call('HDEL', KEYS[1], ARGV[i], ARGV[i] .. ':policy')
end
local left = redis.call('HLEN', KEYS[1])
if left == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return left
