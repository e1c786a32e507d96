-- Extend our port reservation, only if this group still owns it.
-- KEYS[1] port reservation key  KEYS[2] group record
-- ARGV[1] group name  ARGV[2] TTL (seconds)
-- Returns 1 when extended, else 0.

if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
