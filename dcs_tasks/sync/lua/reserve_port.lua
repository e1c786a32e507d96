-- Reserve a port for a group and record it, unless the group already has one.
-- KEYS[1] port reservation key  KEYS[2] group record
-- ARGV[1] group name  ARGV[2] port  ARGV[3] TTL (seconds)
-- Returns the port already recorded (> 0), 0 if this port is taken, -1 if reserved and recorded now.

local have = redis.call('HGET', KEYS[2], 'master_port')
if have then return tonumber(have) end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then return 0 end
redis.call('HSET', KEYS[2], 'master_port', ARGV[2], 'port_checked', '0')
return -1
