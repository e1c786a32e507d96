-- PERSISTING -> FAILED for a save whose persist tasks could not all be sent.
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set  KEYS[3] its end token (StepLedger._k)
-- ARGV[1] token  ARGV[2] reason  ARGV[3] step  ARGV[4] TTL (seconds)
-- Returns 'stale' (another attempt's token), 'closed' (not persisting) or 'ok'.

--#include ended.lua
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HGET', KEYS[1], 'status') ~= 'persisting' then return 'closed' end
redis.call('HSET', KEYS[1], 'status', 'failed', 'reason', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
ended()
return 'ok'
