-- Undo reserve_port.lua: drop the reservation (if the group owns it) and the recorded port (if it is this one).
-- KEYS[1] port reservation key  KEYS[2] group record
-- ARGV[1] group name  ARGV[2] port
-- Returns 0.

if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[2], 'master_port') == ARGV[2] then
  redis.call('HDEL', KEYS[2], 'master_port', 'port_checked')
end
return 0
