-- Mark an existing group record DESTROYED, once: the first reason stays.
-- KEYS[1] group record
-- ARGV[1] now  ARGV[2] reason  ARGV[3] TTL (seconds)
-- Returns 1 when the record exists (now or already destroyed), 0 when it does not.

if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'destroyed' then return 1 end
redis.call('HSET', KEYS[1], 'status', 'destroyed', 'destroyed_at', ARGV[1], 'destroy_reason', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
