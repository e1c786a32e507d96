-- Open a step for writing: -> PERSISTING with a fresh token, unless it is committed, committing, or persisting
-- and begun after ARGV[6].
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set  KEYS[3] its end token (StepLedger._k)
-- ARGV[1] token  ARGV[2] nfiles  ARGV[3] draft  ARGV[4] started (trainer clock)  ARGV[5] step
-- ARGV[6] abandoned_before: a PERSISTING step begun before that time is taken over (its trainer died before
--         sending its tasks, or they can no longer be running)
-- Returns 'committed', 'busy' or 'write'.

--#include fields.lua
local st = status()
if st == 'committed' then return 'committed' end
if st == 'committing' then return 'busy' end
if st == 'persisting' and number('started', false, false) >= tonumber(ARGV[6]) then
  return 'busy'
end
redis.call('DEL', KEYS[1], KEYS[3])  -- an earlier attempt's end token wakes no waiter of this one
redis.call('HSET', KEYS[1], 'status', 'persisting', 'token', ARGV[1], 'nfiles', ARGV[2], 'finished', 0,
           'ok', 0, 'draft', ARGV[3], 'started', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
return 'write'
