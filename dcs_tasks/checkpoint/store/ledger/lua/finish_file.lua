-- Record a file's final outcome, once. Once the step is COMMITTING every file is recorded, so a file not recorded
-- yet is none of this attempt's: 'closed', nothing changes. The last ok file turns the step COMMITTING ('commit');
-- a failed file fails a PERSISTING step.
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set  KEYS[3] its end token (StepLedger._k)
-- ARGV[1] token  ARGV[2] file name  ARGV[3] outcome ('ok', 'failed' or 'skipped')  ARGV[4] FileEntry JSON or reason
-- ARGV[5] step  ARGV[6] TTL (seconds)
-- Returns {verdict, files finished, nfiles, status}: verdict 'stale', 'done', 'closed', 'ok' or 'commit'.

--#include fields.lua
--#include ended.lua
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return {'stale', 0, 0, ''} end
local nfiles = number('nfiles', true, true)
local finished = number('finished', false, true)
local ok = number('ok', false, true)
local st = status()
if redis.call('HEXISTS', KEYS[1], 'done:' .. ARGV[2]) == 1 then return {'done', finished, nfiles, st} end
if st == 'committing' or st == 'committed' then return {'closed', finished, nfiles, st} end
redis.call('HSET', KEYS[1], 'done:' .. ARGV[2], ARGV[3])
finished = redis.call('HINCRBY', KEYS[1], 'finished', 1)
local verdict = 'ok'
if ARGV[3] == 'ok' then
  redis.call('HSET', KEYS[1], 'file:' .. ARGV[2], ARGV[4])
  ok = redis.call('HINCRBY', KEYS[1], 'ok', 1)
  if st == 'persisting' and ok == nfiles then
    redis.call('HSET', KEYS[1], 'status', 'committing')
    st = 'committing'
    verdict = 'commit'
  end
elseif ARGV[3] == 'failed' and st == 'persisting' then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'reason', ARGV[4])
  redis.call('ZREM', KEYS[2], ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[6])
  ended()
  st = 'failed'
end
return {verdict, finished, nfiles, st}
