-- The bootstrap request's epoch, drawn once: a redelivered request gets the epoch its first delivery drew.
-- KEYS[1] bootstrap request key  KEYS[2] epoch counter
-- ARGV[1] TTL of the request key (seconds)
-- Returns the epoch.

local epoch = redis.call('GET', KEYS[1])
if epoch then return tonumber(epoch) end
epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch, 'EX', ARGV[1])
return epoch
