-- Remove nodes dead for longer than the retention, and each role with its last node.
-- KEYS[1] node_beats  KEYS[2] roles  KEYS[3] node_unbeaten
-- ARGV[1] cutoff: nodes whose last beat is older (unix time) go  ARGV[2] most nodes removed per call
-- ARGV[3] role_nodes prefix  ARGV[4] role_owners prefix  ARGV[5] heartbeat prefix (prefix .. role .. ":" .. rank)
-- ARGV[6] role_identities prefix  ARGV[7] role_rank_hint prefix
-- ARGV[8] cutoff of nodes that never beat: registered before it (unix time) and dead, they go too
-- ARGV[9] now (unix time): such a node found alive (its registration time was taken before a long pipeline
--         ran) is looked at again one retention later instead of being forgotten
-- ARGV[10] role_beats prefix  ARGV[11] role_stale prefix (prefix .. role): a removed node leaves them too (pcall:
--          one of another type fails nothing); a node kept stays in them, for rank assignment to find once dead
-- Returns how many entries were processed (== ARGV[2]: call again). A node that beats again in time (its
-- heartbeat key exists) is kept; its next beat puts it back into node_beats.

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
      redis.pcall("ZREM", ARGV[10] .. role, rank)
      redis.pcall("ZREM", ARGV[11] .. role, rank)
      if redis.call("HLEN", nodes) == 0 then
        redis.call("ZREM", KEYS[2], role)
      end
    end
  end
end
return #stale
