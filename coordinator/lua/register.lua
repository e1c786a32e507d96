-- Register a node and make it alive.
-- KEYS[1] role_nodes(role)  H rank -> RoleInfo JSON
-- KEYS[2] role_owners(role) H rank -> "ip:port" identity
-- KEYS[3] roles             Z role -> first-registration order
-- KEYS[4] role_seq          K counter for that order
-- KEYS[5] node_beats        Z "role:rank" -> unix time of the last registration or beat (dead-node sweep)
-- KEYS[6] role_identities(role) H identity -> rank (role_owners inverted)
-- KEYS[7] role_rank_hint(role) K every rank below it has a record (where the free-rank search starts)
-- ARGV[1] role name
-- ARGV[2] requested rank, or "" for "assign one"
-- ARGV[3] identity: "ip:port", or an identity issued for this registration when the node has no port (it
--         never matches an earlier one, so such a node never reclaims a rank); "" = none recorded
-- ARGV[4] RoleInfo JSON without its "rank" field (an object, so it starts with "{")
-- ARGV[5] heartbeat TTL in milliseconds
-- ARGV[6] heartbeat key prefix of the role (prefix .. rank is the heartbeat key)
-- ARGV[7] heartbeat value (unix time of the beat)
-- ARGV[8] "1": an explicit rank whose node is alive (heartbeat key) under another identity is refused
-- KEYS[8] node_unbeaten     Z "role:rank" -> registration time, until the node's first heartbeat
-- Returns {rank, kind}: kind 0 = explicit rank, 1 = same identity re-registered, 2 = smallest free rank,
-- -1 = refused (ARGV[8]): the explicit rank is held by a live node of another identity; nothing changed.
-- Rank policy: an explicit rank always wins (its previous holder is replaced); an identity already holding a
-- rank gets it back; otherwise the smallest rank that is unregistered OR whose node is dead (no heartbeat
-- key) is taken, so a replacement node fills the hole a dead one left. An identity moving to another
-- explicit rank releases its old rank.
-- The identity's rank is found in KEYS[6] (O(1)); the owners hash is scanned only while KEYS[6] is shorter
-- than it (records written before KEYS[6] existed). The smallest free rank is the smaller of the first
-- unregistered rank (searched from KEYS[7], amortized O(1); reset to 0 when the role has fewer records than
-- it, i.e. records went behind the scripts' back) and the smallest registered rank whose node is dead: dead
-- nodes are looked for among node_beats entries older than half the TTL (a live node beats more often),
-- each checked for its heartbeat key. So registering N nodes is O(N), not O(N^2).

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
