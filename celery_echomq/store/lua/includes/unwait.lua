-- left_window(counters, state, chain): a row left 'waiting' for a slot of its flow's window
-- (includes/window.lua) by another way than its window letting it out: cancelled, cut by a
-- deadline, failed by its id, dropped by a forget. The queue's count of children waiting in
-- windows ('window_waiting' in its counters: what the dashboard samples) goes down by one.
-- Called once, by the script that made that one transition (it read ``state`` before its
-- write). A chain's step waiting behind the step before (its row has 'chain') is in no
-- window and was never counted.
local function left_window(counters, state, chain)
  if state == 'waiting' and not chain then
    redis.call('HINCRBY', counters, 'window_waiting', -1)
  end
end
