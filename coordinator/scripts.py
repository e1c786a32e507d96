"""Lua scripts of the topology: each multi-key change is one atomic script with documented KEYS/ARGV.

Each is a `dcs_tasks.lua.LuaScript` (EVALSHA, reloaded after NOSCRIPT): `await SCRIPT.run_async(client, keys, args)`.
The scripts build per-rank heartbeat keys as `prefix .. rank` from a prefix given by
`Keys.heartbeat_role_prefix(role)`, so they are for a standalone (or Sentinel) Redis, as Celery's broker is.
"""

from __future__ import annotations

from dcs_tasks.lua import LuaScript

# Register a node and make it alive.
# KEYS[1] role_nodes(role)  H rank -> RoleInfo JSON
# KEYS[2] role_owners(role) H rank -> "ip:port" identity
# KEYS[3] roles             Z role -> first-registration order
# KEYS[4] role_seq          K counter for that order
# KEYS[5] node_beats        Z "role:rank" -> unix time of the last registration or beat (dead-node sweep)
# KEYS[6] role_identities(role) H identity -> rank (role_owners inverted)
# KEYS[7] role_rank_hint(role) K every rank below it has a record (where the free-rank search starts)
# ARGV[1] role name
# ARGV[2] requested rank, or "" for "assign one"
# ARGV[3] identity: "ip:port", or an identity issued for this registration when the node has no port (it
#         never matches an earlier one, so such a node never reclaims a rank); "" = none recorded
# ARGV[4] RoleInfo JSON without its "rank" field (an object, so it starts with "{")
# ARGV[5] heartbeat TTL in milliseconds
# ARGV[6] heartbeat key prefix of the role (prefix .. rank is the heartbeat key)
# ARGV[7] heartbeat value (unix time of the beat)
# ARGV[8] "1": an explicit rank whose node is alive (heartbeat key) under another identity is refused
# KEYS[8] node_unbeaten     Z "role:rank" -> registration time, until the node's first heartbeat
# Returns {rank, kind}: kind 0 = explicit rank, 1 = same identity re-registered, 2 = smallest free rank,
# -1 = refused (ARGV[8]): the explicit rank is held by a live node of another identity; nothing changed.
# Rank policy: an explicit rank always wins (its previous holder is replaced); an identity already holding a
# rank gets it back; otherwise the smallest rank that is unregistered OR whose node is dead (no heartbeat
# key) is taken, so a replacement node fills the hole a dead one left. An identity moving to another
# explicit rank releases its old rank.
# The identity's rank is found in KEYS[6] (O(1)); the owners hash is scanned only while KEYS[6] is shorter
# than it (records written before KEYS[6] existed). The smallest free rank is the smaller of the first
# unregistered rank (searched from KEYS[7], amortized O(1); reset to 0 when the role has fewer records than
# it, i.e. records went behind the scripts' back) and the smallest registered rank whose node is dead: dead
# nodes are looked for among node_beats entries older than half the TTL (a live node beats more often),
# each checked for its heartbeat key. So registering N nodes is O(N), not O(N^2).
REGISTER = LuaScript(
    """
local rank = tonumber(ARGV[2])
local kind = 0
local ident = ARGV[3]
if rank ~= nil and ARGV[8] == "1" then
  local holder = redis.call("HGET", KEYS[2], rank)
  if holder and holder ~= ident and redis.call("EXISTS", ARGV[6] .. rank) == 1 then
    return {rank, -1}
  end
end
local function lower_hint(freed)
  if tonumber(redis.call("GET", KEYS[7]) or "0") > tonumber(freed) then
    redis.call("SET", KEYS[7], freed)
  end
end
local function release(held)
  lower_hint(held)
  redis.call("HDEL", KEYS[1], held)
  redis.call("HDEL", KEYS[2], held)
  redis.call("DEL", ARGV[6] .. held)
  redis.call("ZREM", KEYS[5], ARGV[1] .. ":" .. held)
end
if ident ~= "" then
  local held = redis.call("HGET", KEYS[6], ident)
  if held and redis.call("HGET", KEYS[2], held) ~= ident then
    held = false
  end
  if not held and redis.call("HLEN", KEYS[6]) < redis.call("HLEN", KEYS[2]) then
    local owners = redis.call("HGETALL", KEYS[2])
    for i = 1, #owners, 2 do
      if owners[i + 1] == ident then
        held = owners[i]
      end
    end
  end
  if held then
    held = tonumber(held)
    if rank == nil then
      rank = held
      kind = 1
    elseif held ~= rank then
      release(held)
    end
  end
end
if rank == nil then
  kind = 2
  rank = tonumber(redis.call("GET", KEYS[7]) or "0")
  if redis.call("HLEN", KEYS[1]) < rank then
    rank = 0
  end
  while redis.call("HEXISTS", KEYS[1], rank) == 1 do
    rank = rank + 1
  end
  redis.call("SET", KEYS[7], rank)
  local prefix = ARGV[1] .. ":"
  local cutoff = tonumber(ARGV[7]) - tonumber(ARGV[5]) / 2000
  for _, member in ipairs(redis.call("ZRANGEBYSCORE", KEYS[5], "-inf", cutoff)) do
    if string.sub(member, 1, #prefix) == prefix then
      local dead = tonumber(string.sub(member, #prefix + 1))
      if dead and dead < rank and redis.call("EXISTS", ARGV[6] .. dead) == 0
          and redis.call("HEXISTS", KEYS[1], dead) == 1 then
        rank = dead
      end
    end
  end
end
redis.call("HSET", KEYS[1], rank, '{"rank":' .. rank .. ',' .. string.sub(ARGV[4], 2))
local previous = redis.call("HGET", KEYS[2], rank)
if previous and previous ~= ident and redis.call("HGET", KEYS[6], previous) == tostring(rank) then
  redis.call("HDEL", KEYS[6], previous)
end
if ident ~= "" then
  redis.call("HSET", KEYS[2], rank, ident)
  redis.call("HSET", KEYS[6], ident, rank)
else
  redis.call("HDEL", KEYS[2], rank)
end
redis.call("SET", ARGV[6] .. rank, ARGV[7], "PX", ARGV[5])
redis.call("ZADD", KEYS[5], ARGV[7], ARGV[1] .. ":" .. rank)
redis.call("ZADD", KEYS[8], ARGV[7], ARGV[1] .. ":" .. rank)
if redis.call("ZSCORE", KEYS[3], ARGV[1]) == false then
  redis.call("ZADD", KEYS[3], redis.call("INCR", KEYS[4]), ARGV[1])
end
return {rank, kind}
"""
)

# Register many nodes in one call (POST /register_batch): REGISTER for each, in order, inside one script (each
# node's registration sees the ones before it), so a batch costs one call instead of one per node.
# KEYS[1] roles  KEYS[2] role_seq  KEYS[3] node_beats  KEYS[4] node_unbeaten
# ARGV[1] heartbeat TTL ms  ARGV[2] heartbeat value (unix time)  ARGV[3] REGISTER's ARGV[8]
# ARGV[4] role_nodes prefix  ARGV[5] role_owners prefix  ARGV[6] role_identities prefix  ARGV[7] role_rank_hint
# prefix  ARGV[8] heartbeat prefix (prefix .. role .. ":" .. rank)
# ARGV[9..] four per node: role, requested rank or "", identity, RoleInfo JSON without "rank" (REGISTER's ARGV)
# Returns rank, kind, rank, kind, ... (REGISTER's answer per node, in order; a refused node changes nothing).
REGISTER_MANY = LuaScript(
    "local function register(KEYS, ARGV)\n"
    + REGISTER.source
    + """end
local out = {}
for i = 9, #ARGV, 4 do
  local role = ARGV[i]
  local keys = {ARGV[4] .. role, ARGV[5] .. role, KEYS[1], KEYS[2], KEYS[3], ARGV[6] .. role, ARGV[7] .. role, KEYS[4]}
  local answer = register(keys, {role, ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[1], ARGV[8] .. role .. ":",
                                 ARGV[2], ARGV[3]})
  out[#out + 1] = answer[1]
  out[#out + 1] = answer[2]
end
return out
"""
)

# Refresh a registered node's heartbeat in one round trip.
# KEYS[1] role_nodes(role)  KEYS[2] heartbeat(role, rank)  KEYS[3] role_owners(role)  KEYS[4] node_beats
# KEYS[5] node_unbeaten (the node's first beat takes it out)
# ARGV[1] rank  ARGV[2] TTL ms  ARGV[3] heartbeat value (unix time of the beat)
# ARGV[4] identity of the beating node (as its registration recorded it), or "" to skip the ownership check
# ARGV[5] node_beats member "role:rank"
# Returns 1 when the beat is recorded (a dead node comes back alive), 0 when (role, rank) is not registered,
# -1 when the rank is now held by another identity (the caller was presumed dead and replaced).
HEARTBEAT = LuaScript(
    """
if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[4] ~= "" and redis.call("HGET", KEYS[3], ARGV[1]) ~= ARGV[4] then
  return -1
end
redis.call("SET", KEYS[2], ARGV[3], "PX", ARGV[2])
redis.call("ZADD", KEYS[4], ARGV[3], ARGV[5])
redis.call("ZREM", KEYS[5], ARGV[5])
return 1
"""
)

# Refresh many nodes' heartbeats in one call (POST /heartbeats): per node what HEARTBEAT does, with the fewest
# Redis calls: the owner read answers registered and fenced at once (the record is read only when there is no
# owner), one SET ... GET refreshes the TTL and returns the previous beat, and the node's node_beats entry (the
# sweep's and rank assignment's last-beat record) and node_unbeaten entry are written only when that previous
# beat is older than ARGV[6] seconds (so a record is at most ARGV[6] + one interval old: the coordinator keeps it
# under half the TTL, which rank assignment relies on).
# KEYS[1] node_beats  KEYS[2] node_unbeaten
# ARGV[1] TTL ms  ARGV[2] heartbeat value (unix time)  ARGV[3] role_nodes prefix  ARGV[4] role_owners prefix
# ARGV[5] heartbeat prefix (prefix .. role .. ":" .. rank)  ARGV[6] record refresh age (seconds, 0: every beat)
# ARGV[7] the beats, "role\nrank\nidentity" each, joined by "\n" (identity "" = unfenced; none holds a "\n")
# Returns one character per beat, in order: "1" beat recorded, "0" not registered, "x" rank held by another
# identity. A heartbeat key that is not a string (a hostile write) is replaced.
HEARTBEAT_MANY = LuaScript(
    """
local ttl, now = ARGV[1], ARGV[2]
local fresh = tonumber(now) - tonumber(ARGV[6])
local nodes_p, owners_p, beat_p, packed = ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local out, beats, members = {}, {}, {}
local pos, size = 1, #packed
local function record()
  redis.call("ZADD", KEYS[1], unpack(beats))
  redis.call("ZREM", KEYS[2], unpack(members))
  beats, members = {}, {}
end
while pos <= size do
  local a = string.find(packed, "\\n", pos, true)
  local b = string.find(packed, "\\n", a + 1, true)
  local c = string.find(packed, "\\n", b + 1, true) or size + 1
  local role, rank = string.sub(packed, pos, a - 1), string.sub(packed, a + 1, b - 1)
  local ident = string.sub(packed, b + 1, c - 1)
  pos = c + 1
  local code = "0"
  local owner = redis.call("HGET", owners_p .. role, rank)
  if owner then
    code = (ident == "" or owner == ident) and "1" or "x"
  elseif redis.call("HEXISTS", nodes_p .. role, rank) == 1 then
    code = ident == "" and "1" or "x"
  end
  if code == "1" then
    local member = role .. ":" .. rank
    local key = beat_p .. member
    local prev = redis.pcall("SET", key, now, "PX", ttl, "GET")
    if type(prev) == "table" then
      redis.call("DEL", key)
      redis.call("SET", key, now, "PX", ttl)
      prev = false
    end
    if not prev or (tonumber(prev) or 0) <= fresh then
      beats[#beats + 1] = now
      beats[#beats + 1] = member
      members[#members + 1] = member
      if #members >= 500 then
        record()
      end
    end
  end
  out[#out + 1] = code
end
if #members > 0 then
  record()
end
return table.concat(out)
"""
)

# Remove a node.
# KEYS[1] role_nodes(role)  KEYS[2] role_owners(role)  KEYS[3] heartbeat(role, rank)  KEYS[4] roles
# KEYS[5] node_beats  KEYS[6] role_identities(role)  KEYS[7] role_rank_hint(role)  KEYS[8] node_unbeaten
# ARGV[1] rank
# ARGV[2] identity of the caller (as its registration recorded it), or "" to skip the ownership check
# ARGV[3] role name
# The role leaves `roles` with its last node (a later registration appends it to the order again).
# Returns 1 when the node was registered and is removed, 0 when it was not registered, -1 (nothing removed)
# when the rank is now held by another identity: a replaced node shutting down must not remove its successor.
UNREGISTER = LuaScript(
    """
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
if redis.call("HLEN", KEYS[1]) == 0 then
  redis.call("ZREM", KEYS[4], ARGV[3])
end
return 1
"""
)

# Remove nodes dead for longer than the retention, and each role with its last node.
# KEYS[1] node_beats  KEYS[2] roles  KEYS[3] node_unbeaten
# ARGV[1] cutoff: nodes whose last beat is older (unix time) go  ARGV[2] most nodes removed per call
# ARGV[3] role_nodes prefix  ARGV[4] role_owners prefix  ARGV[5] heartbeat prefix (prefix .. role .. ":" .. rank)
# ARGV[6] role_identities prefix  ARGV[7] role_rank_hint prefix
# ARGV[8] cutoff of nodes that never beat: registered before it (unix time) and dead, they go too
# ARGV[9] now (unix time): such a node found alive (its registration time was taken before a long pipeline
#         ran) is looked at again one retention later instead of being forgotten
# Returns how many entries were processed (== ARGV[2]: call again). A node that beats again in time (its
# heartbeat key exists) is kept; its next beat puts it back into node_beats.
SWEEP_DEAD_NODES = LuaScript(
    """
local stale = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[1], "LIMIT", 0, tonumber(ARGV[2]))
local unbeaten = redis.call("ZRANGEBYSCORE", KEYS[3], "-inf", ARGV[8], "LIMIT", 0, tonumber(ARGV[2]) - #stale)
for _, member in ipairs(unbeaten) do
  stale[#stale + 1] = member
end
for _, member in ipairs(stale) do
  redis.call("ZREM", KEYS[1], member)
  local role, rank = string.match(member, "^(.+):(%d+)$")
  if role and redis.call("EXISTS", ARGV[5] .. role .. ":" .. rank) == 1 then
    if redis.call("ZSCORE", KEYS[3], member) then
      redis.call("ZADD", KEYS[3], ARGV[9], member)
    end
  else
    redis.call("ZREM", KEYS[3], member)
  end
  if role and redis.call("EXISTS", ARGV[5] .. role .. ":" .. rank) == 0 then
    local nodes = ARGV[3] .. role
    if redis.call("TYPE", nodes)["ok"] == "hash" then
      local owner = redis.call("HGET", ARGV[4] .. role, rank)
      if owner and redis.call("HGET", ARGV[6] .. role, owner) == rank then
        redis.call("HDEL", ARGV[6] .. role, owner)
      end
      if tonumber(redis.call("GET", ARGV[7] .. role) or "0") > tonumber(rank) then
        redis.call("SET", ARGV[7] .. role, rank)
      end
      redis.call("HDEL", nodes, rank)
      redis.call("HDEL", ARGV[4] .. role, rank)
      if redis.call("HLEN", nodes) == 0 then
        redis.call("ZREM", KEYS[2], role)
      end
    end
  end
end
return #stale
"""
)

# Drop roles without any node record from the role order, a bounded slice per call (roles left behind by
# data written before roles went with their last node, or by hand).
# KEYS[1] roles  ARGV[1] first position of the slice  ARGV[2] slice length  ARGV[3] role_nodes prefix
# Returns {position to continue from (0: wrapped around), roles removed}.
PRUNE_EMPTY_ROLES = LuaScript(
    """
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
"""
)

# A consistent snapshot of several roles.
# KEYS[i]  role_nodes(role_i)
# ARGV[i]  heartbeat key prefix of role_i
# ARGV[#KEYS + 1]  "1": live nodes only (dead ones are neither read nor returned: reads of the live topology
#                  stay as fast with thousands of dead registrations as without)
# Returns, per role, a flat list {rank, RoleInfo JSON, heartbeat PTTL, ...}; PTTL -2 = dead (no key).
# A key that is not a hash (corrupt) gives {"!" .. its type} instead, so one bad key does not fail the read.
SNAPSHOT = LuaScript(
    """
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
"""
)

# Append one weight-meta entry at most once per append id, trim the log to its bound, wake long-polls.
# KEYS[1] weight_meta()  L of entries
# KEYS[2] weight_meta_append(append_id)  K marker holding the answer of that append
# KEYS[3] weight_meta_base()  K absolute index of the list's first entry (absent: 0)
# ARGV[1] entry JSON  ARGV[2] pub/sub channel weight_meta_channel()  ARGV[3] marker TTL in milliseconds
# ARGV[4] most entries kept (0: all)
# Returns the entry's absolute index + 1; a repeat of the same append id (redis-py retries a command whose
# reply was lost to a timeout or reset) returns the first answer and adds nothing.
APPEND_WEIGHT_META = LuaScript(
    """
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
)

# Read a bounded slice of the weight-meta log from an absolute index.
# KEYS[1] weight_meta()  KEYS[2] weight_meta_base()
# ARGV[1] absolute index  ARGV[2] most entries (0: none, only the indices)  ARGV[3] most bytes of entries
# (the first entry is always returned, so a reader always progresses)
# Returns {base, length of the list, entries from max(index, base)}; the log's absolute end is base + length.
# Entries are fetched in small chunks, so one call never copies more than the caps (plus one chunk).
READ_WEIGHT_META = LuaScript(
    """
local base = tonumber(redis.call("GET", KEYS[2]) or "0")
local length = redis.call("LLEN", KEYS[1])
local start = tonumber(ARGV[1]) - base
if start < 0 then
  start = 0
end
local limit = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
local out = {}
local used = 0
while start < length and #out < limit do
  local chunk = redis.call("LRANGE", KEYS[1], start, start + math.min(31, limit - #out - 1))
  for _, item in ipairs(chunk) do
    if #out > 0 and used + #item > budget then
      return {base, length, out}
    end
    out[#out + 1] = item
    used = used + #item
  end
  start = start + #chunk
end
return {base, length, out}
"""
)

# Empty the weight-meta log, keeping indices absolute: the base moves past the dropped entries.
# KEYS[1] weight_meta()  KEYS[2] weight_meta_base()   Returns how many entries were dropped.
CLEAR_WEIGHT_META = LuaScript(
    """
local n = redis.call("LLEN", KEYS[1])
if n > 0 then
  redis.call("DEL", KEYS[1])
  redis.call("INCRBY", KEYS[2], n)
end
return n
"""
)
