-- remember.lua: store a request's manifest, keep its record, and renew the TTLs of its stored chunks
-- (cache.py AudioCache.remember).
-- KEYS: the request's chunk keys, then its manifest's key, then the ledger of kept records (keys.RETAINED_KEY).
-- ARGV: 1 ttl (s), 2 the manifest (JSON), 3 the request id, 4 now (unix seconds).
-- Returns, per chunk, 1 when its audio is stored, else 0.
-- Steps:
-- 1. Each stored chunk's TTL is renewed, except a chunk without one: a request in flight holds it, and its
--    end starts the TTL (work/pool.py Pool.store).
-- 2. The manifest is (re)written without a TTL: the ledger says how long the record is kept, and no
--    volatile-* eviction can take a key without one.
-- 3. The record is kept at least a TTL from now; a record held while its job is active (+inf) stays held.
local found = {}
local n = #KEYS - 2
for i = 1, n do
  local left = redis.call('PTTL', KEYS[i])
  if left == -2 then found[i] = 0
  elseif left == -1 then found[i] = 1
  else found[i] = redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
redis.call('SET', KEYS[n + 1], ARGV[2])
redis.call('ZADD', KEYS[n + 2], 'GT', tonumber(ARGV[4]) + tonumber(ARGV[1]), ARGV[3])
return found
