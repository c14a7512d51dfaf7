-- renew.lua: extend this worker's leases on its chunks (work/pool.py Pool.renew).
-- KEYS: the claims. ARGV: 1 token, 2 lease (ms).
-- Returns how many leases this worker still held.
-- Steps:
-- 1. Each claim still holding this worker's token gets the lease again; others are left as they are.
local kept = 0
for _, claim in ipairs(KEYS) do
  if redis.call('GET', claim) == ARGV[1] then redis.call('PEXPIRE', claim, ARGV[2]); kept = kept + 1 end
end
return kept
