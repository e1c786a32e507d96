-- Create a group record unless it exists.
-- KEYS[1] group record (hash)
-- ARGV[1] TTL (seconds)  ARGV[2..] field/value pairs of the new record
-- Returns the record's status (the existing one's, or the new one's).

local status = redis.call('HGET', KEYS[1], 'status')
if status then return status end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('HGET', KEYS[1], 'status')
