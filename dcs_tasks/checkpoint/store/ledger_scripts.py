"""Lua scripts of the checkpoint step ledger (`dcs_tasks.checkpoint.store.ledger`): each fenced transition of a
step is one script, run by SHA through `dcs_tasks.lua`. KEYS[1] is the step's state hash, KEYS[2] the run's
in-flight set (`StepLedger._k`).

A record whose status is none of the four, or whose counters or start time are not numbers (edited by hand, or
damaged), is refused by BEGIN and FINISH_FILE before anything is written, with an error reply starting
`CORRUPT_PREFIX` that names the key and the field (`StepLedger` raises it as `CorruptLedger`); the other
scripts only go ahead from a known status, so an unknown one gets 'closed'.
"""

from __future__ import annotations

from dcs_tasks.lua import LuaScript

CORRUPT_PREFIX = "DCSCORRUPT"  # how the errors of `_FIELDS` start

# Lua: `status()`, the step's status (false when absent) or an error when it is none of the four; `number(field,
# required, count)`, `field` of KEYS[1] as a number (`count`: a whole number >= 0) or an error naming it
# (`required`: absent is corrupt too, else it reads 0)
_FIELDS = """
local function status()
  local st = redis.call('HGET', KEYS[1], 'status')
  if st and st ~= 'persisting' and st ~= 'committing' and st ~= 'committed' and st ~= 'failed' then
    error({err = 'DCSCORRUPT field status of ' .. KEYS[1] .. ' is no step status: ' .. string.sub(st, 1, 64)})
  end
  return st
end

local function number(field, required, count)
  local raw = redis.call('HGET', KEYS[1], field)
  if not raw and not required then return 0 end
  local n = raw and tonumber(raw)
  if count and raw and not string.match(raw, '^%d+$') then n = nil end
  if not n then
    local shown = string.sub(tostring(raw), 1, 64)
    error({err = 'DCSCORRUPT field ' .. field .. ' of ' .. KEYS[1] .. ' is not a number: ' .. shown})
  end
  return n
end
"""

# ARGV: token, nfiles, draft, started (trainer clock), step, abandoned_before: a PERSISTING step begun before
# that time is taken over (its trainer died before sending its tasks, or they can no longer be running)
BEGIN = LuaScript(
    _FIELDS
    + """
local st = status()
if st == 'committed' then return 'committed' end
if st == 'committing' then return 'busy' end
if st == 'persisting' and number('started', false, false) >= tonumber(ARGV[6]) then
  return 'busy'
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'persisting', 'token', ARGV[1], 'nfiles', ARGV[2], 'finished', 0,
           'ok', 0, 'draft', ARGV[3], 'started', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
return 'write'
"""
)

# ARGV: token, reason, step, ttl.  PERSISTING -> FAILED for a save whose persist tasks could not all be sent.
ABANDON = LuaScript(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HGET', KEYS[1], 'status') ~= 'persisting' then return 'closed' end
redis.call('HSET', KEYS[1], 'status', 'failed', 'reason', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 'ok'
"""
)

CLAIM_FILE = LuaScript(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HEXISTS', KEYS[1], 'done:' .. ARGV[2]) == 1 then return 'done' end
if redis.call('HGET', KEYS[1], 'status') ~= 'persisting' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'claim:' .. ARGV[2])
if owner and owner ~= ARGV[3] then return 'claimed' end
redis.call('HSET', KEYS[1], 'claim:' .. ARGV[2], ARGV[3])
return 'write'
"""
)

# ARGV: token, file, outcome, value (FileEntry JSON or reason), step, ttl.  Once the step is COMMITTING every file
# is recorded, so a file not recorded yet is none of this attempt's: 'closed', nothing changes.
FINISH_FILE = LuaScript(
    _FIELDS
    + """
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
  st = 'failed'
end
return {verdict, finished, nfiles, st}
"""
)

CLAIM_COMMIT = LuaScript(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'committed' then return 'done' end
if st ~= 'committing' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'commit_owner')
if owner and owner ~= ARGV[2] then return 'claimed' end
redis.call('HSET', KEYS[1], 'commit_owner', ARGV[2])
return 'write'
"""
)

# ARGV: token, new status (committed|failed), reason, step, ttl, task id.  Another task's claimed commit is
# refused: a duplicate commit task that fails for good must not fail a commit the owner is writing.
FINISH_COMMIT = LuaScript(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'stale' end
if redis.call('HGET', KEYS[1], 'status') ~= 'committing' then return 'closed' end
local owner = redis.call('HGET', KEYS[1], 'commit_owner')
if owner and owner ~= ARGV[6] then return 'claimed' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'reason', ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 'ok'
"""
)
