-- COMMITTING -> committed or failed. Another task's claimed commit is refused: a duplicate commit task that fails
-- for good must not fail a commit the owner is writing.
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set  KEYS[3] its end token (StepLedger._k)
-- ARGV[1] token  ARGV[2] new status (committed|failed)  ARGV[3] reason  ARGV[4] step  ARGV[5] TTL (seconds)
-- ARGV[6] task id
-- Returns 'stale', 'closed', 'claimed' or 'ok'.

--#include ended.lua
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HGET', KEYS[1], 'status') ~= 'committing' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'commit_owner')
if owner and owner ~= ARGV[6] then return 'claimed' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'reason', ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
ended()
return 'ok'
