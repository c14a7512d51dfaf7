-- remember.lua: store a request's manifest and renew the TTLs of its stored chunks (cache.py AudioCache.remember).
-- KEYS: the request's chunk keys, then its manifest's key.
-- ARGV: 1 ttl (s), 2 the manifest (JSON).
-- Returns, per chunk, 1 when its audio is stored, else 0.
-- Steps:
-- 1. Each stored chunk's TTL is renewed, except a chunk without one: a request in flight holds it, and its
--    end starts the TTL (work/scheduler.py Pool.store).
-- 2. The manifest is (re)written with the same TTL.
local found = {}
for i = 1, #KEYS - 1 do
  local left = redis.call('PTTL', KEYS[i])
  if left == -2 then found[i] = 0
  elseif left == -1 then found[i] = 1
  else found[i] = redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
redis.call('SET', KEYS[#KEYS], ARGV[2], 'EX', ARGV[1])
return found
