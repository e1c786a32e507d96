-- Release a port reservation, only if this group still owns it (dcs_tasks/sync/group_bootstrap.py).
-- KEYS[1] port reservation key
-- ARGV[1] group name that must own it
-- Returns 1 if the reservation was deleted, else 0.

if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
