--- @include "keys"
-- each_step_after(row, id, next_id, apply): apply(key) to the row of every step after ``id``
-- (its row ``row``, its 'next' ``next_id``) in its linked chain, following each row's 'next'
-- (the last step has none). Each step's row is on ``row``'s slot (row_beside, from "keys"),
-- since a linked run's steps share a queue. What a failed or cut step does to the steps that
-- wait behind it (expire them with it, so that no key of a failed chain outlives the result
-- TTL), and a retry undoes (persist them again). One HGET and one call of ``apply`` a step.
local function each_step_after(row, id, next_id, apply)
  local following = next_id
  while following do
    local key = row_beside(row, following)
    apply(key)
    following = redis.call('HGET', key, 'next')
  end
end

local function expire_steps_after(row, id, next_id, ttl)
  each_step_after(row, id, next_id, function(key)
    redis.call('EXPIRE', key, ttl)
  end)
end

local function persist_steps_after(row, id, next_id)
  each_step_after(row, id, next_id, function(key)
    redis.call('PERSIST', key)
  end)
end
