"""The Lua scripts of the weight-sync group bootstrap (`dcs_tasks.sync.group_bootstrap`): port reservations and
group records, each change made in one script so that a redelivered bootstrap finds what an earlier delivery did.
"""

from __future__ import annotations

from dcs_tasks.lua import LuaScript

# KEYS[1] = reservation key; ARGV[1] = group name that must own it. Returns 1 if deleted.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] = bootstrap request key, KEYS[2] = epoch counter; ARGV[1] = TTL. The request's epoch, drawn once.
_EPOCH_LUA = """
local epoch = redis.call('GET', KEYS[1])
if epoch then return tonumber(epoch) end
epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch, 'EX', ARGV[1])
return epoch
"""

# KEYS[1] = group record; ARGV[1] = TTL, then field/value pairs. Creates the record unless it exists; returns
# its status.
_OPEN_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status then return status end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('HGET', KEYS[1], 'status')
"""

# KEYS[1] = reservation key, KEYS[2] = group record; ARGV[1] = group, ARGV[2] = port, ARGV[3] = TTL.
# The port already recorded (> 0), 0 if this port is taken, -1 if reserved and recorded now.
_RESERVE_LUA = """
local have = redis.call('HGET', KEYS[2], 'master_port')
if have then return tonumber(have) end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then return 0 end
redis.call('HSET', KEYS[2], 'master_port', ARGV[2], 'port_checked', '0')
return -1
"""

# KEYS[1] = reservation key, KEYS[2] = group record; ARGV[1] = group, ARGV[2] = port. Undo _RESERVE_LUA.
_UNRESERVE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[2], 'master_port') == ARGV[2] then
  redis.call('HDEL', KEYS[2], 'master_port', 'port_checked')
end
return 0
"""

# KEYS[1] = group record; ARGV[1] = node id ('' for none), ARGV[2] = now, ARGV[3] = record TTL once READY.
# Counts a joined engine once; turns a BOOTSTRAPPING record READY when every engine joined. 1 when it did.
_JOINED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] ~= '' and redis.call('HSETNX', KEYS[1], 'joined:' .. ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'joined_count', 1)
end
if redis.call('HGET', KEYS[1], 'status') ~= 'bootstrapping' then return 0 end
local joined = tonumber(redis.call('HGET', KEYS[1], 'joined_count') or '0')
if joined < tonumber(redis.call('HGET', KEYS[1], 'engines') or '0') then return 0 end
redis.call('HSET', KEYS[1], 'status', 'ready', 'ready_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1] = reservation key, KEYS[2] = group record; ARGV[1] = group, ARGV[2] = TTL. Extends our reservation.
_EXTEND_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS[1] = group record; ARGV[1] = now, ARGV[2] = reason, ARGV[3] = TTL. Marks an existing record DESTROYED
# (once: the first reason stays).
_DESTROYED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'destroyed' then return 1 end
redis.call('HSET', KEYS[1], 'status', 'destroyed', 'destroyed_at', ARGV[1], 'destroy_reason', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# each loaded once per Redis, then run by SHA (dcs_tasks/lua.py)
RELEASE_PORT = LuaScript(_RELEASE_LUA)
CLAIM_EPOCH = LuaScript(_EPOCH_LUA)
OPEN_RECORD = LuaScript(_OPEN_LUA)
RESERVE_PORT = LuaScript(_RESERVE_LUA)
UNRESERVE_PORT = LuaScript(_UNRESERVE_LUA)
MARK_JOINED = LuaScript(_JOINED_LUA)
EXTEND_RESERVATION = LuaScript(_EXTEND_LUA)
MARK_DESTROYED = LuaScript(_DESTROYED_LUA)
