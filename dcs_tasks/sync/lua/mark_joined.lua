-- Count a joined engine once; turn a BOOTSTRAPPING record READY when every engine joined.
-- KEYS[1] group record
-- ARGV[1] node id ('' for none)  ARGV[2] now  ARGV[3] record TTL once READY (seconds)
-- Returns 1 when the record turned READY now, else 0.

if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] ~= '' and redis.call('HSETNX', KEYS[1], 'joined:' .. ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'joined_count', 1)
end
if redis.call('HGET', KEYS[1], 'status') ~= 'bootstrapping' then return 0 end
local joined = tonumber(redis.call('HGET', KEYS[1], 'joined_count') or '0')
if joined < tonumber(redis.call('HGET', KEYS[1], 'engines') or '0') then return 0 end
redis.call('HSET', KEYS[1], 'status', 'ready', 'ready_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
