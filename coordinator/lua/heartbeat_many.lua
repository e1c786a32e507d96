-- Refresh many nodes' heartbeats in one call (POST /heartbeats): per node what HEARTBEAT does, with the fewest
-- Redis calls: the owner read answers registered and fenced at once (the record is read only when there is no
-- owner), one SET ... GET refreshes the TTL and returns the previous beat, and the node's node_beats entry (the
-- sweep's last-beat record), role_beats entry (rank assignment's; its role_stale entry goes) and node_unbeaten
-- entry are written only when this beat and the previous one fall in different periods of ARGV[6] seconds (the
-- node's periods are offset by a phase drawn from its rank, so a fleet's rewrites spread evenly over time rather
-- than all following each period's start). No read of the record is needed: every writer of the heartbeat key
-- (register, HEARTBEAT, this script) records a beat whenever its period differs from the key's previous value's,
-- so the record is always from the period of the key's value, under ARGV[6] older than the last beat. Beating
-- every interval, a node's record is under ARGV[6] + one interval old, one write per node per ARGV[6] seconds
-- (the coordinator keeps it under half the TTL, which rank assignment relies on). Comparing the previous beat's
-- age with ARGV[6] instead would never rewrite the record of a node beating more often than ARGV[6].
-- KEYS[1] node_beats  KEYS[2] node_unbeaten
-- ARGV[1] TTL ms  ARGV[2] heartbeat value (unix time)  ARGV[3] role_nodes prefix  ARGV[4] role_owners prefix
-- ARGV[5] heartbeat prefix (prefix .. role .. ":" .. rank)  ARGV[6] record refresh period (seconds, 0: every beat)
-- ARGV[7] the beats, "role\nrank\nidentity" each, joined by "\n" (identity "" = unfenced; none holds a "\n")
-- ARGV[8] role_beats prefix  ARGV[9] role_stale prefix (prefix .. role; written with pcall: one of another type
-- fails no beat, register.lua rebuilds it)
-- Returns one character per beat, in order: "1" beat recorded, "0" not registered, "x" rank held by another
-- identity. A heartbeat key that is not a string (a hostile write) is replaced.

local ttl, now = ARGV[1], ARGV[2]
local now_s, period = tonumber(now), tonumber(ARGV[6])
local nodes_p, owners_p, beat_p, packed = ARGV[3], ARGV[4], ARGV[5], ARGV[7]
local role_beats_p, role_stale_p = ARGV[8], ARGV[9]
local out, beats, members, by_role = {}, {}, {}, {}
local pos, size = 1, #packed
local function record()
  redis.call("ZADD", KEYS[1], unpack(beats))
  redis.call("ZREM", KEYS[2], unpack(members))
  for role, ranks in pairs(by_role) do
    local scored = {}
    for i, rank in ipairs(ranks) do
      scored[2 * i - 1] = now
      scored[2 * i] = rank
    end
    redis.pcall("ZADD", role_beats_p .. role, unpack(scored))
    redis.pcall("ZREM", role_stale_p .. role, unpack(ranks))
  end
  beats, members, by_role = {}, {}, {}
end
while pos <= size do
  local a = string.find(packed, "\n", pos, true)
  local b = string.find(packed, "\n", a + 1, true)
  local c = string.find(packed, "\n", b + 1, true) or size + 1
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
    local due = true
    local prev_s = prev and tonumber(prev)
    if prev_s and period > 0 then
      local phase = (tonumber(rank) or 0) * 0.6180339887498949 % 1 * period
      due = math.floor((now_s + phase) / period) ~= math.floor((prev_s + phase) / period)
    end
    if due then
      beats[#beats + 1] = now
      beats[#beats + 1] = member
      members[#members + 1] = member
      local ranks = by_role[role]
      if not ranks then
        ranks = {}
        by_role[role] = ranks
      end
      ranks[#ranks + 1] = rank
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
