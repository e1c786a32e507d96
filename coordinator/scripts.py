"""Lua scripts of the topology: each multi-key change is one atomic script with documented KEYS/ARGV.

The scripts build per-rank heartbeat keys as `prefix .. rank` from a prefix given by
`Keys.heartbeat_role_prefix(role)`, so they are for a standalone (or Sentinel) Redis, as Celery's broker is.
"""

from __future__ import annotations

# Register a node and make it alive.
# KEYS[1] role_nodes(role)  H rank -> RoleInfo JSON
# KEYS[2] role_owners(role) H rank -> "ip:port" identity
# KEYS[3] roles             Z role -> first-registration order
# KEYS[4] role_seq          K counter for that order
# ARGV[1] role name
# ARGV[2] requested rank, or "" for "assign one"
# ARGV[3] identity: "ip:port", or an identity issued for this registration when the node has no port (it
#         never matches an earlier one, so such a node never reclaims a rank); "" = none recorded
# ARGV[4] RoleInfo JSON without its "rank" field (an object, so it starts with "{")
# ARGV[5] heartbeat TTL in milliseconds
# ARGV[6] heartbeat key prefix of the role (prefix .. rank is the heartbeat key)
# ARGV[7] heartbeat value (unix time of the beat)
# Returns {rank, kind}: kind 0 = explicit rank, 1 = same identity re-registered, 2 = smallest free rank.
# Rank policy: an explicit rank always wins (its previous holder is replaced); an identity already holding a
# rank gets it back; otherwise the smallest rank that is unregistered OR whose node is dead (no heartbeat
# key) is taken, so a replacement node fills the hole a dead one left. An identity moving to another
# explicit rank releases its old rank.
REGISTER = """
local rank = tonumber(ARGV[2])
local kind = 0
local ident = ARGV[3]
if ident ~= "" then
  local owners = redis.call("HGETALL", KEYS[2])
  for i = 1, #owners, 2 do
    if owners[i + 1] == ident then
      local held = tonumber(owners[i])
      if rank == nil then
        rank = held
        kind = 1
      elseif held ~= rank then
        redis.call("HDEL", KEYS[1], held)
        redis.call("HDEL", KEYS[2], held)
        redis.call("DEL", ARGV[6] .. held)
      end
    end
  end
end
if rank == nil then
  kind = 2
  rank = 0
  while redis.call("HEXISTS", KEYS[1], rank) == 1 and redis.call("EXISTS", ARGV[6] .. rank) == 1 do
    rank = rank + 1
  end
end
redis.call("HSET", KEYS[1], rank, '{"rank":' .. rank .. ',' .. string.sub(ARGV[4], 2))
if ident ~= "" then
  redis.call("HSET", KEYS[2], rank, ident)
else
  redis.call("HDEL", KEYS[2], rank)
end
redis.call("SET", ARGV[6] .. rank, ARGV[7], "PX", ARGV[5])
if redis.call("ZSCORE", KEYS[3], ARGV[1]) == false then
  redis.call("ZADD", KEYS[3], redis.call("INCR", KEYS[4]), ARGV[1])
end
return {rank, kind}
"""

# Refresh a registered node's heartbeat in one round trip.
# KEYS[1] role_nodes(role)  KEYS[2] heartbeat(role, rank)  KEYS[3] role_owners(role)
# ARGV[1] rank  ARGV[2] TTL ms  ARGV[3] heartbeat value
# ARGV[4] identity of the beating node (as its registration recorded it), or "" to skip the ownership check
# Returns 1 when the beat is recorded (a dead node comes back alive), 0 when (role, rank) is not registered,
# -1 when the rank is now held by another identity (the caller was presumed dead and replaced).
HEARTBEAT = """
if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[4] ~= "" and redis.call("HGET", KEYS[3], ARGV[1]) ~= ARGV[4] then
  return -1
end
redis.call("SET", KEYS[2], ARGV[3], "PX", ARGV[2])
return 1
"""

# Remove a node.
# KEYS[1] role_nodes(role)  KEYS[2] role_owners(role)  KEYS[3] heartbeat(role, rank)
# ARGV[1] rank
# ARGV[2] identity of the caller (as its registration recorded it), or "" to skip the ownership check
# Returns 1 when the node was registered and is removed, 0 when it was not registered, -1 (nothing removed)
# when the rank is now held by another identity: a replaced node shutting down must not remove its successor.
UNREGISTER = """
if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[2] ~= "" and redis.call("HGET", KEYS[2], ARGV[1]) ~= ARGV[2] then
  return -1
end
redis.call("HDEL", KEYS[1], ARGV[1])
redis.call("HDEL", KEYS[2], ARGV[1])
redis.call("DEL", KEYS[3])
return 1
"""

# A consistent snapshot of several roles.
# KEYS[i]  role_nodes(role_i)
# ARGV[i]  heartbeat key prefix of role_i
# Returns, per role, a flat list {rank, RoleInfo JSON, heartbeat PTTL, ...}; PTTL -2 = dead (no key).
SNAPSHOT = """
local out = {}
for i = 1, #KEYS do
  local nodes = redis.call("HGETALL", KEYS[i])
  local role = {}
  for j = 1, #nodes, 2 do
    role[#role + 1] = nodes[j]
    role[#role + 1] = nodes[j + 1]
    role[#role + 1] = redis.call("PTTL", ARGV[i] .. nodes[j])
  end
  out[i] = role
end
return out
"""

# Append one weight-meta entry at most once per append id, trim the log to its bound, wake long-polls.
# KEYS[1] weight_meta()  L of entries
# KEYS[2] weight_meta_append(append_id)  K marker holding the answer of that append
# KEYS[3] weight_meta_base()  K absolute index of the list's first entry (absent: 0)
# ARGV[1] entry JSON  ARGV[2] pub/sub channel weight_meta_channel()  ARGV[3] marker TTL in milliseconds
# ARGV[4] most entries kept (0: all)
# Returns the entry's absolute index + 1; a repeat of the same append id (redis-py retries a command whose
# reply was lost to a timeout or reset) returns the first answer and adds nothing.
APPEND_WEIGHT_META = """
local done = redis.call("GET", KEYS[2])
if done then
  return tonumber(done)
end
local length = redis.call("RPUSH", KEYS[1], ARGV[1])
local base = tonumber(redis.call("GET", KEYS[3]) or "0")
local keep = tonumber(ARGV[4])
if keep > 0 and length > keep then
  redis.call("LTRIM", KEYS[1], length - keep, -1)
  base = redis.call("INCRBY", KEYS[3], length - keep)
  length = keep
end
redis.call("SET", KEYS[2], base + length, "PX", ARGV[3])
redis.call("PUBLISH", ARGV[2], "append")
return base + length
"""

# Read the weight-meta log from an absolute index.
# KEYS[1] weight_meta()  KEYS[2] weight_meta_base()  ARGV[1] absolute index
# Returns {base, entries from max(index, base)}.
READ_WEIGHT_META = """
local base = tonumber(redis.call("GET", KEYS[2]) or "0")
local start = tonumber(ARGV[1]) - base
if start < 0 then
  start = 0
end
return {base, redis.call("LRANGE", KEYS[1], start, -1)}
"""

# Empty the weight-meta log, keeping indices absolute: the base moves past the dropped entries.
# KEYS[1] weight_meta()  KEYS[2] weight_meta_base()   Returns how many entries were dropped.
CLEAR_WEIGHT_META = """
local n = redis.call("LLEN", KEYS[1])
if n > 0 then
  redis.call("DEL", KEYS[1])
  redis.call("INCRBY", KEYS[2], n)
end
return n
"""
