-- drop_interest.lua: a tenant no longer wants a request; when nobody does, it is canceled
-- (work/interest.py withdraw).
-- KEYS: 1 the request's tenants, 2 those that dropped it, 3 its cancel mark.
-- ARGV: 1 tenant.
-- Returns 1 when the cancel mark was set (no tenant wants the request), else 0.
-- Steps:
-- 1. The tenant leaves the set of those who want the request.
-- 2. It joins those who dropped it.
-- 3. When nobody wants the request any more, the cancel mark is set.
-- All three are part of the request's record: no TTL, kept as long as the ledger says (work/lifetime.py).
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('SET', KEYS[3], 1)
  return 1
end
return 0
