-- Claim one file of a PERSISTING step for a persist task (a redelivered task of the same id claims it again).
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set (StepLedger._k)
-- ARGV[1] token  ARGV[2] file name  ARGV[3] task id
-- Returns 'stale', 'done' (already recorded), 'closed' (not persisting), 'claimed' (another task's) or 'write'.

if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HEXISTS', KEYS[1], 'done:' .. ARGV[2]) == 1 then return 'done' end
if redis.call('HGET', KEYS[1], 'status') ~= 'persisting' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'claim:' .. ARGV[2])
if owner and owner ~= ARGV[3] then return 'claimed' end
redis.call('HSET', KEYS[1], 'claim:' .. ARGV[2], ARGV[3])
return 'write'
