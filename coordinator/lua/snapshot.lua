-- A consistent snapshot of several roles.
-- KEYS[i]  role_nodes(role_i)
-- ARGV[i]  heartbeat key prefix of role_i
-- ARGV[#KEYS + 1]  "1": live nodes only (dead ones are neither read nor returned: reads of the live topology
--                  stay as fast with thousands of dead registrations as without)
-- Returns, per role, a flat list {rank, RoleInfo JSON, heartbeat PTTL, ...}; PTTL -2 = dead (no key).
-- A key that is not a hash (corrupt) gives {"!" .. its type} instead, so one bad key does not fail the read.

local out = {}
local alive_only = ARGV[#KEYS + 1] == "1"
for i = 1, #KEYS do
  local kind = redis.call("TYPE", KEYS[i])["ok"]
  local role = {}
  if kind == "hash" and alive_only then
    for _, rank in ipairs(redis.call("HKEYS", KEYS[i])) do
      local ttl = redis.call("PTTL", ARGV[i] .. rank)
      if ttl ~= -2 then
        role[#role + 1] = rank
        role[#role + 1] = redis.call("HGET", KEYS[i], rank)
        role[#role + 1] = ttl
      end
    end
  elseif kind == "hash" then
    local nodes = redis.call("HGETALL", KEYS[i])
    for j = 1, #nodes, 2 do
      role[#role + 1] = nodes[j]
      role[#role + 1] = nodes[j + 1]
      role[#role + 1] = redis.call("PTTL", ARGV[i] .. nodes[j])
    end
  elseif kind ~= "none" then
    role = {"!" .. kind}
  end
  out[i] = role
end
return out
