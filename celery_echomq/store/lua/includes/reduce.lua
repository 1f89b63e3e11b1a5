-- fold_value(spec, acc, value): a flow's reducer (flow(..., reduce=R), send/fan_in.py) applied
-- to one child's value. spec: the reducer as JSON ('["sum"]', '["top", 3, "score"]'); acc: the
-- accumulator so far, JSON, as the parent's row keeps it ('acc'; false before the first);
-- value: the child's value, JSON. Returns the new accumulator as JSON, or nil and the reason
-- the value cannot be folded. Writes nothing: the caller writes the accumulator in the step
-- that credits the child (settle_child), so exactly once per child.
local function fold_value(spec, acc, value)
  spec = cjson.decode(spec)
  local name = spec[1]
  if name == 'count' then
    return tostring(math.floor((acc and tonumber(acc) or 0) + 1))
  end
  if name == 'list' then
    -- The value's own JSON appended as is: what the child returned, never re-encoded.
    if not acc then
      return '[' .. value .. ']'
    end
    if #cjson.decode(acc) >= spec[2] then
      return acc
    end
    return string.sub(acc, 1, -2) .. ', ' .. value .. ']'
  end
  local ok, v = pcall(cjson.decode, value)
  if not ok then
    return nil, name .. ' folds JSON values, not ' .. string.sub(value, 1, 80)
  end
  -- The value named as the refusal names it (send/fan_in.py): its Python type, then its
  -- JSON cut at 80 bytes. cjson decodes {} and [] alike: a dict is told by its text.
  local kind
  if v == cjson.null then
    kind = 'NoneType'
  elseif type(v) == 'string' then
    kind = 'str'
  elseif type(v) == 'boolean' then
    kind = 'bool'
  elseif type(v) == 'number' then
    kind = string.find(value, '[%.eE]') and 'float' or 'int'
  else
    kind = string.match(value, '^%s*{') and 'dict' or 'list'
  end
  local shown = kind .. ' ' .. string.sub(value, 1, 80)
  if name == 'sum' or name == 'min' or name == 'max' then
    if kind ~= 'int' and kind ~= 'float' then
      return nil, name .. ' folds numbers, not ' .. shown
    end
    local before = acc and tonumber(acc)
    if name == 'sum' then
      v = (before or 0) + v
    elseif before and ((name == 'min' and before < v) or (name == 'max' and before > v)) then
      return acc
    end
    return cjson.encode(v)
  end
  if kind ~= 'dict' then
    if name == 'merge' then
      return nil, 'merge folds dicts, not ' .. shown
    end
    return nil, "top folds dicts with the key '" .. spec[3] .. "', not " .. shown
  end
  local into = acc and cjson.decode(acc) or {}
  if name == 'merge' then
    for k, item in pairs(v) do
      into[k] = item
    end
    if next(into) == nil then
      return '{}'
    end
    return cjson.encode(into)
  end
  -- top n key: the n largest by v[key], largest first, earlier first among equals.
  local score = v[spec[3]]
  if type(score) ~= 'number' then
    return nil, "top folds dicts with the key '" .. spec[3] .. "', not " .. shown
  end
  local at = #into + 1
  for i, old in ipairs(into) do
    if score > old[spec[3]] then
      at = i
      break
    end
  end
  table.insert(into, at, v)
  while #into > spec[2] do
    table.remove(into)
  end
  return cjson.encode(into)
end
