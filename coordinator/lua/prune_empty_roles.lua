-- Drop roles without any node record from the role order, a bounded slice per call (roles left behind by
-- data written before roles went with their last node, or by hand).
-- KEYS[1] roles  ARGV[1] first position of the slice  ARGV[2] slice length  ARGV[3] role_nodes prefix
-- Returns {position to continue from (0: wrapped around), roles removed}.

local start = tonumber(ARGV[1])
local roles = redis.call("ZRANGE", KEYS[1], start, start + tonumber(ARGV[2]) - 1)
local removed = 0
for _, role in ipairs(roles) do
  if redis.call("EXISTS", ARGV[3] .. role) == 0 then
    redis.call("ZREM", KEYS[1], role)
    removed = removed + 1
  end
end
local nxt = start + #roles - removed
if #roles < tonumber(ARGV[2]) then
  nxt = 0
end
return {nxt, removed}
