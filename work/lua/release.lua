-- release.lua: give up this worker's leases, so the chunks are open again at once (work/pool.py Pool.release).
-- KEYS: the claims. ARGV: 1 token.
-- Returns 1.
-- Steps:
-- 1. Each claim still holding this worker's token is dropped; another worker's is left.
for _, claim in ipairs(KEYS) do
  if redis.call('GET', claim) == ARGV[1] then redis.call('DEL', claim) end
end
return 1
