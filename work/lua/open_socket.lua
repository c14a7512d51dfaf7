-- open_socket.lua: may a tenant open one more socket? (web/sockets.py Lease)
-- KEYS: 1 the tenant's open sockets (keys.sockets_key), scored by when each one's lease lapses.
-- ARGV: 1 the socket's id, 2 now (unix ms), 3 the lease (ms), 4 the most sockets the tenant may hold.
-- Returns 1 when the socket is counted (opened), else 0 (the tenant holds the most it may).
-- Steps:
-- 1. Sockets whose lease lapsed (their process died without closing them) are forgotten.
-- 2. Past the limit: refused. Else the socket is counted, its lease from now, and the set itself expires with the
--    longest lease (so a tenant's set never outlives its sockets).
local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
return 1
