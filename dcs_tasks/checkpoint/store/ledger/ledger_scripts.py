"""Lua scripts of the checkpoint step ledger (`dcs_tasks.checkpoint.store.ledger.stepledger`): each fenced
transition of a step is one script, its source in `lua/` beside this module (KEYS and ARGV documented at the top
of each file), read once at import and run by SHA through `dcs_tasks.lua`. KEYS[1] is the step's state hash,
KEYS[2] the run's in-flight set (`StepLedger._k`).

A record whose status is none of the four, or whose counters or start time are not numbers (edited by hand, or
damaged), is refused by BEGIN and FINISH_FILE before anything is written, with an error reply starting
`CORRUPT_PREFIX` (`lua/fields.lua`) that names the key and the field (`StepLedger` raises it as `CorruptLedger`);
the other scripts only go ahead from a known status, so an unknown one gets 'closed'.
"""

from __future__ import annotations

from dcs_tasks.lua import lua_script

CORRUPT_PREFIX = "DCSCORRUPT"  # how the errors of lua/fields.lua start

BEGIN = lua_script(__file__, "begin.lua")
ABANDON = lua_script(__file__, "abandon.lua")
CLAIM_FILE = lua_script(__file__, "claim_file.lua")
FINISH_FILE = lua_script(__file__, "finish_file.lua")
CLAIM_COMMIT = lua_script(__file__, "claim_commit.lua")
FINISH_COMMIT = lua_script(__file__, "finish_commit.lua")
PASS_ON_END = lua_script(__file__, "pass_on_end.lua")
