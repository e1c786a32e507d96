-- Refresh many nodes' heartbeats in one call (POST /heartbeats): per node what HEARTBEAT does, with the fewest
-- Redis calls: one HMGET per role reads the beating nodes' owners (registered and fenced at once; the record is
-- read only when there is no owner), one SET ... PX ... GET per node sets the key's value to the beat's time,
-- refreshes its TTL and returns the value it held (the time of the node's previous beat), and the records are
-- written only when due, in a few batched calls:
-- - role_beats (rank assignment's index; its role_stale entry goes) when this beat and the previous one fall in
--   different periods of ARGV[6] seconds, scored half the TTL after the beat: half the TTL before the heartbeat
--   key this beat set runs out, as register.lua scores a node it finds alive. Rank assignment takes entries older
--   than half the TTL as maybe dead, so an entry ages past that only when the key it was written for may have run
--   out; a node beating every interval (or up to 1.5 intervals apart) with ARGV[6] at most the TTL less 1.5
--   intervals never does before its next write, and a dead node always does by the time its key is gone.
-- - node_beats (the dead-node sweep's last-beat record, scored with the beat's time; its node_unbeaten entry
--   goes) when the two fall in different periods of ARGV[10] seconds: it lags the last beat by under ARGV[10],
--   which is how much sooner than its retention a dead node may be swept. The sweep puts a live node it finds
--   behind back into node_beats (sweep_dead_nodes.lua), so how seldom this is written is no risk to a live node.
-- - both at once when the value is not a time: none (the key had run out, or was of another type: replaced), a
--   registration's mark ("r" .. time, register.lua: the node's first beat, so it leaves node_unbeaten at once) or
--   a hostile value.
-- No read of the records is needed: every writer of the key's value (register, HEARTBEAT, this script) leaves
-- each record from the period of the value (register and HEARTBEAT write them every time; this script when a
-- period's boundary lies between the previous beat and this one), so a record is rewritten once per period.
-- Each node's periods are offset by a phase drawn from its rank, so a fleet's rewrites spread evenly over time
-- rather than all following each period's start.
-- KEYS[1] node_beats  KEYS[2] node_unbeaten
-- ARGV[1] TTL ms  ARGV[2] heartbeat value (unix time)  ARGV[3] role_nodes prefix  ARGV[4] role_owners prefix
-- ARGV[5] heartbeat prefix (prefix .. role .. ":" .. rank)  ARGV[6] role_beats refresh period (seconds, 0: every
-- beat)  ARGV[7] the beats, "role\nrank\nidentity" each, joined by "\n" (identity "" = unfenced; none holds a "\n")
-- ARGV[8] role_beats prefix  ARGV[9] role_stale prefix (prefix .. role; written with pcall: one of another type
-- fails no beat, register.lua rebuilds it)  ARGV[10] node_beats refresh period (seconds, 0: every beat; absent:
-- ARGV[6])
-- Returns one character per beat, in order: "1" beat recorded, "0" not registered, "x" rank held by another
-- identity.

local rcall, rpcall, tonumber = redis.call, redis.pcall, tonumber
local ttl, now = ARGV[1], ARGV[2]
local now_s = tonumber(now)
local role_period, node_period = tonumber(ARGV[6]), tonumber(ARGV[10] or ARGV[6])
local role_score = string.format("%.17g", now_s + tonumber(ttl) / 2000)
local nodes_p, owners_p, beat_p = ARGV[3], ARGV[4], ARGV[5]
local role_beats_p, role_stale_p = ARGV[8], ARGV[9]
-- append `value` to the list at lists[key], made on first use
local function push(lists, key, value)
  local list = lists[key]
  if not list then
    list = {}
    lists[key] = list
  end
  list[#list + 1] = value
end
-- whether a record written at `prev_s` is from another period of `period` seconds than now (phase-offset)
local function due(period, phase, prev_s)
  if period <= 0 then
    return true
  end
  local start = now_s - (now_s + phase * period) % period
  return prev_s < start or prev_s >= start + period
end
local roles, ranks, idents, groups, count = {}, {}, {}, {}, 0
for role, rank, ident in string.gmatch(ARGV[7] .. "\n", "([^\n]*)\n([^\n]*)\n([^\n]*)\n") do
  count = count + 1
  roles[count], ranks[count], idents[count] = role, rank, ident
  push(groups, role, count)
end
local owners = {}
for role, group in pairs(groups) do
  for first = 1, #group, 1000 do
    local last = math.min(#group, first + 999)
    local fields = {}
    for j = first, last do
      fields[j - first + 1] = ranks[group[j]]
    end
    local found = rcall("HMGET", owners_p .. role, unpack(fields))
    for j = first, last do
      owners[group[j]] = found[j - first + 1]
    end
  end
end
local beats, members, by_role, pending = {}, {}, {}, 0
local function record()
  if #members > 0 then
    rcall("ZADD", KEYS[1], unpack(beats))
    rcall("ZREM", KEYS[2], unpack(members))
  end
  for role, ranks_due in pairs(by_role) do
    local scored = {}
    for i, rank in ipairs(ranks_due) do
      scored[2 * i - 1] = role_score
      scored[2 * i] = rank
    end
    rpcall("ZADD", role_beats_p .. role, unpack(scored))
    rpcall("ZREM", role_stale_p .. role, unpack(ranks_due))
  end
  beats, members, by_role, pending = {}, {}, {}, 0
end
local out = {}
for i = 1, count do
  local role, rank, ident, owner = roles[i], ranks[i], idents[i], owners[i]
  local code = "0"
  if owner then
    code = (ident == "" or owner == ident) and "1" or "x"
  elseif rcall("HEXISTS", nodes_p .. role, rank) == 1 then
    code = ident == "" and "1" or "x"
  end
  if code == "1" then
    local key = beat_p .. role .. ":" .. rank
    local prev = rpcall("SET", key, now, "PX", ttl, "GET")
    local prev_s = tonumber(prev)
    if prev_s and prev_s - prev_s ~= 0 then
      prev_s = nil
    end
    local role_due, node_due = true, true
    if type(prev) == "table" then
      rcall("DEL", key)
      rcall("SET", key, now, "PX", ttl)
    elseif prev_s then
      local phase = (tonumber(rank) or 0) * 0.6180339887498949 % 1
      role_due, node_due = due(role_period, phase, prev_s), due(node_period, phase, prev_s)
    end
    if node_due then
      local member = role .. ":" .. rank
      beats[#beats + 1] = now
      beats[#beats + 1] = member
      members[#members + 1] = member
      pending = pending + 1
    end
    if role_due then
      push(by_role, role, rank)
      pending = pending + 1
    end
    if pending >= 500 then
      record()
    end
  end
  out[i] = code
end
if pending > 0 then
  record()
end
return table.concat(out)
