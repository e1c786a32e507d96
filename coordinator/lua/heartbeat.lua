-- Refresh a registered node's heartbeat in one round trip.
-- KEYS[1] role_nodes(role)  KEYS[2] heartbeat(role, rank)  KEYS[3] role_owners(role)  KEYS[4] node_beats
-- KEYS[5] node_unbeaten (the node's first beat takes it out)
-- KEYS[6] role_beats(role) (rank -> last beat, for rank assignment)  KEYS[7] role_stale(role) (the beat takes it out)
-- ARGV[1] rank  ARGV[2] TTL ms  ARGV[3] heartbeat value (unix time of the beat)
-- ARGV[4] identity of the beating node (as its registration recorded it), or "" to skip the ownership check
-- ARGV[5] node_beats member "role:rank"
-- Returns 1 when the beat is recorded (a dead node comes back alive), 0 when (role, rank) is not registered,
-- -1 when the rank is now held by another identity (the caller was presumed dead and replaced).
-- KEYS[6] and KEYS[7] are written with pcall: one of another type (corrupt) fails no beat (register.lua rebuilds it).

if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[4] ~= "" and redis.call("HGET", KEYS[3], ARGV[1]) ~= ARGV[4] then
  return -1
end
redis.call("SET", KEYS[2], ARGV[3], "PX", ARGV[2])
redis.call("ZADD", KEYS[4], ARGV[3], ARGV[5])
redis.call("ZREM", KEYS[5], ARGV[5])
redis.pcall("ZADD", KEYS[6], ARGV[3], ARGV[1])
redis.pcall("ZREM", KEYS[7], ARGV[1])
return 1
