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
-- Returns how many entries were processed (== ARGV[2]: call again). A node found alive (its heartbeat key exists)
-- is kept, and kept in node_beats: scored again with the key's value (the time of its last beat, or "r" .. the
-- registration's time until its first beat; the sweep's now when that is no time after the cutoff), since a
-- batched beat rewrites node_beats only once per refresh period (heartbeat_many.lua), which may be longer than
-- what the sweep leaves a record. A node still in node_unbeaten whose key holds a beat's time later than its
-- registration has beaten (a beat that did not take it out, e.g. of an older coordinator): it leaves
-- node_unbeaten, so once dead it is kept for the dead-node retention.

local stale = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[1], "LIMIT", 0, tonumber(ARGV[2]))
local unbeaten = redis.call("ZRANGEBYSCORE", KEYS[3], "-inf", ARGV[8], "LIMIT", 0, tonumber(ARGV[2]) - #stale)
for _, member in ipairs(unbeaten) do
  stale[#stale + 1] = member
end
local cutoff = tonumber(ARGV[1])
for _, member in ipairs(stale) do
  local role, rank = string.match(member, "^(.+):(%d+)$")
  local key = role and ARGV[5] .. role .. ":" .. rank
  local alive = key and redis.call("EXISTS", key) == 1
  if alive then
    local value = redis.pcall("GET", key)
    local beaten = type(value) == "string" and tonumber(value)
    if beaten and not (beaten > -math.huge and beaten < math.huge) then
      beaten = nil
    end
    local last = beaten or (type(value) == "string" and tonumber(string.match(value, "^r(.*)$") or ""))
    if not last or not (last > cutoff and last < math.huge) then
      last = ARGV[9]
    end
    redis.call("ZADD", KEYS[1], last, member)
    local since = redis.call("ZSCORE", KEYS[3], member)
    if since and beaten and beaten > tonumber(since) then
      redis.call("ZREM", KEYS[3], member)
    elseif since then
      redis.call("ZADD", KEYS[3], ARGV[9], member)
    end
  else
    redis.call("ZREM", KEYS[1], member)
    redis.call("ZREM", KEYS[3], member)
  end
  if key and not alive then
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
