-- Put back the end token a waiter took (StepLedger.pass_on_end) for the step's other waiters.
-- KEYS[1] the step's state hash  KEYS[2] the run's in-flight set  KEYS[3] its end token (StepLedger._k)
-- Returns 'ok'.

--#include ended.lua
ended()
return 'ok'
