-- Read a bounded slice of the weight-meta log from an absolute index.
-- KEYS[1] weight_meta()  KEYS[2] weight_meta_base()
-- ARGV[1] absolute index  ARGV[2] most entries (0: none, only the indices)  ARGV[3] most bytes of entries
-- (the first entry is always returned, so a reader always progresses)
-- Returns {base, length of the list, entries from max(index, base)}; the log's absolute end is base + length.
-- Entries are fetched in small chunks, so one call never copies more than the caps (plus one chunk).

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
