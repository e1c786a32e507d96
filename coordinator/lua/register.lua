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
-- ARGV[7] time of the registration (unix time); the heartbeat key holds "r" .. it until the node's first beat, a
--         mark that has a batched beat record the node's first beat at once (heartbeat_many.lua)
-- ARGV[8] "1": an explicit rank whose node is alive (heartbeat key) under another identity is refused
-- KEYS[8] node_unbeaten     Z "role:rank" -> registration time, until the node's first heartbeat
-- KEYS[9] role_beats(role)  Z rank -> a time at least half the TTL before the node's heartbeat key (as its last
--                           recorded registration or beat set it) runs out, for the role's nodes not in KEYS[10]:
--                           a registration's or single beat's time, a batched beat's time plus half the TTL
-- KEYS[10] role_stale(role) Z rank -> rank: nodes whose KEYS[9] entry aged past half the TTL (maybe dead)
-- Returns {rank, kind}: kind 0 = explicit rank, 1 = same identity re-registered, 2 = smallest free rank,
-- -1 = refused (ARGV[8]): the explicit rank is held by a live node of another identity; nothing changed.
-- Rank policy: an explicit rank always wins (its previous holder is replaced); an identity already holding a
-- rank gets it back; otherwise the smallest rank that is unregistered OR whose node is dead (no heartbeat
-- key) is taken, so a replacement node fills the hole a dead one left. An identity moving to another
-- explicit rank releases its old rank.
-- The identity's rank is found in KEYS[6] (O(1)); the owners hash is scanned only while KEYS[6] is shorter
-- than it (records written before KEYS[6] existed). The smallest free rank is the smaller of the first
-- unregistered rank (searched from KEYS[7], amortized O(1); reset to 0 when the role has fewer records than
-- it, i.e. records went behind the scripts' back) and the smallest registered rank whose node is dead. Dead
-- nodes are looked for among the role's own last beats (KEYS[9], not node_beats, which holds every role's):
-- entries older than half the TTL (the node's key may have run out; a live node's entry is rewritten before)
-- move to KEYS[10], ordered by rank, and the smallest ranks there are checked for their heartbeat key: a dead
-- one is taken; a live one goes back to KEYS[9] scored half the TTL before its heartbeat key runs out (so it
-- ages past the cutoff when it may have died, not before); one without a record is dropped. An entry is moved
-- and checked once per beat it records and once at its heartbeat key's end, so a registration costs O(log N)
-- amortized however many dead nodes this or any other role has, and registering N nodes is O(N log N), not
-- O(N^2).
-- Records that KEYS[9] and KEYS[10] do not hold (written before they existed, or behind the scripts' back) are
-- added to KEYS[9] with their node_beats score (0 without one) whenever the two hold fewer entries than the
-- role has records; a KEYS[9] or KEYS[10] of another type (corrupt) is dropped and so rebuilt.

local rank = tonumber(ARGV[2])
local kind = 0
local ident = ARGV[3]
if rank ~= nil and ARGV[8] == "1" then
  local holder = redis.call("HGET", KEYS[2], rank)
  if holder and holder ~= ident and redis.call("EXISTS", ARGV[6] .. rank) == 1 then
    return {rank, -1}
  end
end
for _, key in ipairs({KEYS[9], KEYS[10]}) do
  local found = redis.call("TYPE", key)["ok"]
  if found ~= "zset" and found ~= "none" then
    redis.call("DEL", key)
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
  redis.call("ZREM", KEYS[9], held)
  redis.call("ZREM", KEYS[10], held)
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
  if redis.call("ZCARD", KEYS[9]) + redis.call("ZCARD", KEYS[10]) < redis.call("HLEN", KEYS[1]) then
    for _, held in ipairs(redis.call("HKEYS", KEYS[1])) do
      if not redis.call("ZSCORE", KEYS[9], held) and not redis.call("ZSCORE", KEYS[10], held) then
        redis.call("ZADD", KEYS[9], redis.call("ZSCORE", KEYS[5], ARGV[1] .. ":" .. held) or 0, held)
      end
    end
  end
  local now, ttl = tonumber(ARGV[7]), tonumber(ARGV[5]) / 1000
  local cutoff = now - ttl / 2
  local aged = redis.call("ZRANGEBYSCORE", KEYS[9], "-inf", cutoff)
  if #aged > 0 then
    redis.call("ZREMRANGEBYSCORE", KEYS[9], "-inf", cutoff)
    local moved = {}
    for i, member in ipairs(aged) do
      local r = tonumber(member)
      -- a member that is not a plain rank (a hostile record's field) is kept, never checked (score +inf)
      local plain = r ~= nil and r >= 0 and r == math.floor(r) and tostring(r) == member
      moved[#moved + 1] = plain and member or "+inf"
      moved[#moved + 1] = member
      if #moved >= 1000 or i == #aged then
        redis.call("ZADD", KEYS[10], unpack(moved))
        moved = {}
      end
    end
  end
  while true do
    local dead = redis.call("ZRANGEBYSCORE", KEYS[10], "-inf", "(" .. rank, "LIMIT", 0, 1)[1]
    if not dead then
      break
    end
    if redis.call("HEXISTS", KEYS[1], dead) == 0 then
      redis.call("ZREM", KEYS[10], dead)
    else
      local left = redis.call("PTTL", ARGV[6] .. dead)
      if left == -2 then
        rank = tonumber(dead)
        break
      end
      redis.call("ZREM", KEYS[10], dead)
      redis.call("ZADD", KEYS[9], left < 0 and now or now + left / 1000 - ttl / 2, dead)
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
redis.call("SET", ARGV[6] .. rank, "r" .. ARGV[7], "PX", ARGV[5])
redis.call("ZADD", KEYS[5], ARGV[7], ARGV[1] .. ":" .. rank)
redis.call("ZADD", KEYS[8], ARGV[7], ARGV[1] .. ":" .. rank)
redis.call("ZADD", KEYS[9], ARGV[7], rank)
redis.call("ZREM", KEYS[10], rank)
if redis.call("ZSCORE", KEYS[3], ARGV[1]) == false then
  redis.call("ZADD", KEYS[3], redis.call("INCR", KEYS[4]), ARGV[1])
end
return {rank, kind}
