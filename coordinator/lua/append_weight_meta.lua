-- Append one weight-meta entry at most once per append id, trim the log to its bound, wake long-polls.
-- KEYS[1] weight_meta()  L of entries
-- KEYS[2] weight_meta_append(append_id)  K marker holding the answer of that append
-- KEYS[3] weight_meta_base()  K absolute index of the list's first entry (absent: 0)
-- ARGV[1] entry JSON  ARGV[2] pub/sub channel weight_meta_channel()  ARGV[3] marker TTL in milliseconds
-- ARGV[4] most entries kept (0: all)
-- Returns the entry's absolute index + 1; a repeat of the same append id (redis-py retries a command whose
-- reply was lost to a timeout or reset) returns the first answer and adds nothing.

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
