-- fail.lua: mark chunks the model could not make, so that their requests fail (work/pool.py Pool.fail).
-- Uses: forget.lua
-- KEYS: 1 pool (its own lane), 2 turns, then (failed, waiters, task, claim) per chunk.
-- ARGV: 1 token, 2 slot, 3 reason, 4 ttl of the mark (s), 5 events prefix, 6 lane prefix (common/keys),
--   then the chunk ids.
-- The prefixes: as in complete.lua, lanes and waiters are known only as the script runs.
-- Returns 1.
-- Steps:
-- 1. The pool's lanes (lanes_of).
-- 2. Per chunk: the failure mark first (the waiters woken next must find it); then forget the chunk (out
--    of every lane, its requests woken, waiters and task dropped); then drop this worker's claim on it.
local pool, turns, token, slot, reason, ttl = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local events, lanes = ARGV[5], lanes_of(pool, turns, ARGV[6])
for c = 0, #ARGV - 7 do
  local failed, w, task, claim = KEYS[3 + 4 * c], KEYS[4 + 4 * c], KEYS[5 + 4 * c], KEYS[6 + 4 * c]
  redis.call('SET', failed, reason, 'EX', ttl)
  forget(lanes, w, task, ARGV[7 + c], events, slot, 0)
  if redis.call('GET', claim) == token then redis.call('DEL', claim) end
end
return 1
