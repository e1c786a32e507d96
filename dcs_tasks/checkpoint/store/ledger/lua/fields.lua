-- Included (--#include fields.lua) by the ledger scripts that validate a record before writing to it.
-- status(): the step's status (false when absent), or an error when it is none of the four.
-- number(field, required, count): `field` of KEYS[1] as a number (`count`: a whole number >= 0), or an error
-- naming it (`required`: absent is corrupt too, else it reads 0).
-- The errors start with DCSCORRUPT (ledger_scripts.CORRUPT_PREFIX); StepLedger raises them as CorruptLedger.

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

