-- Remove a node.
-- KEYS[1] role_nodes(role)  KEYS[2] role_owners(role)  KEYS[3] heartbeat(role, rank)  KEYS[4] roles
-- KEYS[5] node_beats  KEYS[6] role_identities(role)  KEYS[7] role_rank_hint(role)  KEYS[8] node_unbeaten
-- KEYS[9] role_beats(role)  KEYS[10] role_stale(role) (removed with pcall: one of another type fails nothing)
-- ARGV[1] rank
-- ARGV[2] identity of the caller (as its registration recorded it), or "" to skip the ownership check
-- ARGV[3] role name
-- The role leaves `roles` with its last node (a later registration appends it to the order again).
-- Returns 1 when the node was registered and is removed, 0 when it was not registered, -1 (nothing removed)
-- when the rank is now held by another identity: a replaced node shutting down must not remove its successor.

if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[2] ~= "" and redis.call("HGET", KEYS[2], ARGV[1]) ~= ARGV[2] then
  return -1
end
local owner = redis.call("HGET", KEYS[2], ARGV[1])
if owner and redis.call("HGET", KEYS[6], owner) == ARGV[1] then
  redis.call("HDEL", KEYS[6], owner)
end
if tonumber(redis.call("GET", KEYS[7]) or "0") > tonumber(ARGV[1]) then
  redis.call("SET", KEYS[7], ARGV[1])
end
redis.call("HDEL", KEYS[1], ARGV[1])
redis.call("HDEL", KEYS[2], ARGV[1])
redis.call("DEL", KEYS[3])
redis.call("ZREM", KEYS[5], ARGV[3] .. ":" .. ARGV[1])
redis.call("ZREM", KEYS[8], ARGV[3] .. ":" .. ARGV[1])
redis.pcall("ZREM", KEYS[9], ARGV[1])
redis.pcall("ZREM", KEYS[10], ARGV[1])
if redis.call("HLEN", KEYS[1]) == 0 then
  redis.call("ZREM", KEYS[4], ARGV[3])
end
return 1
