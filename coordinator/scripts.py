"""Lua scripts of the topology: each multi-key change is one atomic script, its source in `coordinator/lua/` with
its KEYS and ARGV documented at the top of the file.

Each is a `dcs_tasks.lua.LuaScript` read once at import (EVALSHA, reloaded after NOSCRIPT):
`await SCRIPT.run_async(client, keys, args)`.
The scripts build per-rank heartbeat keys as `prefix .. rank` from a prefix given by
`Keys.heartbeat_role_prefix(role)`, so they are for a standalone (or Sentinel) Redis, as Celery's broker is.
"""

from __future__ import annotations

from dcs_tasks.lua import lua_script

REGISTER = lua_script(__file__, "register.lua")
REGISTER_MANY = lua_script(__file__, "register_many.lua")
HEARTBEAT = lua_script(__file__, "heartbeat.lua")
HEARTBEAT_MANY = lua_script(__file__, "heartbeat_many.lua")
UNREGISTER = lua_script(__file__, "unregister.lua")
SWEEP_DEAD_NODES = lua_script(__file__, "sweep_dead_nodes.lua")
PRUNE_EMPTY_ROLES = lua_script(__file__, "prune_empty_roles.lua")
SNAPSHOT = lua_script(__file__, "snapshot.lua")
APPEND_WEIGHT_META = lua_script(__file__, "append_weight_meta.lua")
READ_WEIGHT_META = lua_script(__file__, "read_weight_meta.lua")
CLEAR_WEIGHT_META = lua_script(__file__, "clear_weight_meta.lua")
