-- Claim the commit of a COMMITTING step for one commit task.
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set (StepLedger._k)
-- ARGV[1] token  ARGV[2] task id
-- Returns 'stale', 'done' (committed), 'closed' (not committing), 'claimed' (another task's) or 'write'.

if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'committed' then return 'done' end
if st ~= 'committing' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'commit_owner')
if owner and owner ~= ARGV[2] then return 'claimed' end
redis.call('HSET', KEYS[1], 'commit_owner', ARGV[2])
return 'write'
