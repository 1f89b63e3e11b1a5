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
local adding_key = KEYS[1]
local adding_set_key = KEYS[2]
--- @include "gate"
local refused = gate_ids(1, #ARGV)
if refused then
  return refused
end
for i = 2, #ARGV do
  redis.call('HDEL', adding_key, ARGV[i], ARGV[i] .. ':policy')
end
local left = redis.call('HLEN', adding_key)
if left == 0 then
  redis.call('ZREM', adding_set_key, ARGV[1])
end
return left
