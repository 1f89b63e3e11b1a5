-- is_placeholder(row, outer): whether ``row`` (HMGET of 'state', 'parent', 'attempts') is the
-- placeholder an outer flow wrote for a nested flow's parent: pending, naming ``outer`` as its
-- parent, never attempted. The one row a nested flow's enqueue may find and take over; any
-- other row under that id refuses (EMQEXISTS); its 'format', read fourth, one newer than this
-- release knows refuses first (EMQFORMAT).
--- @include "format"
local function is_placeholder(row, outer)
  return outer ~= '' and row[1] == 'pending' and row[2] == outer and row[3] == '0'
end
