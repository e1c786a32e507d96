-- Empty the weight-meta log, keeping indices absolute: the base moves past the dropped entries.
-- KEYS[1] weight_meta()  KEYS[2] weight_meta_base()   Returns how many entries were dropped.

local n = redis.call("LLEN", KEYS[1])
if n > 0 then
  redis.call("DEL", KEYS[1])
  redis.call("INCRBY", KEYS[2], n)
end
return n
