"""The Lua scripts of the weight-sync group bootstrap (`dcs_tasks.sync.group_bootstrap`): port reservations and
group records, each change made in one script so that a redelivered bootstrap finds what an earlier delivery did.
The sources are in `lua/` beside this module, KEYS and ARGV documented at the top of each file; each is read once
at import, loaded into Redis once and then run by SHA (dcs_tasks/lua.py).
"""

from __future__ import annotations

from dcs_tasks.lua import lua_script

RELEASE_PORT = lua_script(__file__, "release_port.lua")
CLAIM_EPOCH = lua_script(__file__, "claim_epoch.lua")
OPEN_RECORD = lua_script(__file__, "open_record.lua")
RESERVE_PORT = lua_script(__file__, "reserve_port.lua")
UNRESERVE_PORT = lua_script(__file__, "unreserve_port.lua")
MARK_JOINED = lua_script(__file__, "mark_joined.lua")
EXTEND_RESERVATION = lua_script(__file__, "extend_reservation.lua")
MARK_DESTROYED = lua_script(__file__, "mark_destroyed.lua")
