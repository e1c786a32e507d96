-- Register many nodes in one call (POST /register_batch): register.lua for each, in order, inside one script (each
-- node's registration sees the ones before it), so a batch costs one call instead of one per node.
-- KEYS[1] roles  KEYS[2] role_seq  KEYS[3] node_beats  KEYS[4] node_unbeaten
-- ARGV[1] heartbeat TTL ms  ARGV[2] heartbeat value (unix time)  ARGV[3] register.lua's ARGV[8]
-- ARGV[4] role_nodes prefix  ARGV[5] role_owners prefix  ARGV[6] role_identities prefix  ARGV[7] role_rank_hint
-- prefix  ARGV[8] heartbeat prefix (prefix .. role .. ":" .. rank)  ARGV[9] role_beats prefix  ARGV[10] role_stale
-- prefix
-- ARGV[11..] four per node: role, requested rank or "", identity, RoleInfo JSON without "rank" (register.lua's ARGV)
-- Returns rank, kind, rank, kind, ... (register.lua's answer per node, in order; a refused node changes nothing).

local function register(KEYS, ARGV)
--#include register.lua
end
local out = {}
for i = 11, #ARGV, 4 do
  local role = ARGV[i]
  local keys = {ARGV[4] .. role, ARGV[5] .. role, KEYS[1], KEYS[2], KEYS[3], ARGV[6] .. role, ARGV[7] .. role, KEYS[4],
                ARGV[9] .. role, ARGV[10] .. role}
  local answer = register(keys, {role, ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[1], ARGV[8] .. role .. ":",
                                 ARGV[2], ARGV[3]})
  out[#out + 1] = answer[1]
  out[#out + 1] = answer[2]
end
return out
