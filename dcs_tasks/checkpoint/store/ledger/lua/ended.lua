-- Included (--#include ended.lua) by the ledger scripts that end a step (COMMITTED or FAILED), and by
-- pass_on_end.lua, which puts a taken token back.
-- ended(): push a token on KEYS[3] (Keys.ckpt_ended), which the step's waiters block on between polls
-- (StepLedger.nap); it expires after 60 s, far beyond any waiter's poll. With pcall: a key of another type (not
-- DCS's) costs the waiters their early wake-up, never the transition.

local function ended()
  redis.pcall('RPUSH', KEYS[3], 1)
  redis.pcall('EXPIRE', KEYS[3], 60)
end
