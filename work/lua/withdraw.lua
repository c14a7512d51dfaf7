-- withdraw.lua: a request no longer waits for its chunks; those nobody else waits for leave the pool
-- (work/pool.py Pool.withdraw).
-- Uses: forget.lua
-- KEYS: 1 pool (its own lane), 2 turns, then (waiters, task) per chunk.
-- ARGV: 1 request, 2 lane prefix (common/keys), then the chunk ids.
-- The lane prefix: the tenants' lanes are known only from the turns as the script runs (lanes_of).
-- Returns 1.
-- Steps:
-- 1. The pool's lanes (lanes_of).
-- 2. Per chunk: the request's entry leaves every lane and the request leaves the chunk's waiters; a chunk
--    nobody waits for any more loses its waiters and task (a claim in progress still finishes and stores
--    it, harmlessly).
local pool, r = KEYS[1], ARGV[1]
local lanes = lanes_of(pool, KEYS[2], ARGV[2])
for c = 0, #ARGV - 3 do
  local w, task = KEYS[3 + 2 * c], KEYS[4 + 2 * c]
  for _, lane in ipairs(lanes) do redis.call('ZREM', lane, r .. ':' .. ARGV[3 + c]) end
  redis.call('SREM', w, r)
  if redis.call('SCARD', w) == 0 then redis.call('DEL', w, task) end
end
return 1
