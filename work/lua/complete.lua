-- complete.lua: take chunks whose audio is now stored out of the pool and wake their requests
-- (work/pool.py Pool.complete).
-- Uses: forget.lua
-- KEYS: 1 pool (its own lane), 2 turns, then (waiters, task, claim) per chunk.
-- ARGV: 1 token, 2 slot, 3 events prefix, 4 lane prefix, 5 hooks prefix (common/keys), then the chunk ids.
-- The prefixes: the tenants' lanes are known only from the turns, and the requests to wake (and their
-- callbacks) only from each chunk's waiters, as the script runs (forget.lua).
-- Returns two lists: (request id, milliseconds since it arrived) for each request whose first chunk this
-- was; and each request woken that has callback URLs registered, once (its events may be due: hooks/events.py
-- `if_all_stored`).
-- Steps:
-- 1. The pool's lanes (lanes_of) and the time now (milliseconds modulo the slot).
-- 2. Per chunk: note its waiters with callbacks; forget it (out of every lane, its requests woken, waiters and task dropped), noting
--    first chunks; then drop this worker's claim on it (another worker's is left).
local pool, turns, token, slot, events = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local hooks = ARGV[5]
local lanes = lanes_of(pool, turns, ARGV[4])
local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot

local firsts, hooked, seen = {}, {}, {}
for c = 0, #ARGV - 6 do
  local w, task, claim = KEYS[3 + 3 * c], KEYS[4 + 3 * c], KEYS[5 + 3 * c]
  for _, r in ipairs(redis.call('SMEMBERS', w)) do
    if not seen[r] then
      seen[r] = true
      if redis.call('EXISTS', hooks .. r) == 1 then hooked[#hooked + 1] = r end
    end
  end
  for _, v in ipairs(forget(lanes, w, task, ARGV[6 + c], events, slot, now)) do firsts[#firsts + 1] = v end
  if redis.call('GET', claim) == token then redis.call('DEL', claim) end
end
return {firsts, hooked}
