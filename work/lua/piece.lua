-- piece.lua: store the next piece of a chunk this worker is making and tell every request waiting for it
-- (work/pool.py Pool.piece).
-- KEYS: 1 the chunk's pieces list, 2 its claim, 3 its waiters.
-- ARGV: 1 events prefix, 2 chunk id, 3 piece index, 4 PCM16 bytes, 5 ttl (s), 6 the claiming token.
-- The events prefix: the channels to announce on are each waiter's, known only from KEYS[3] as it runs.
-- Returns the piece's index in the list, or -1 (nothing stored) when this worker no longer holds the lease.
-- Steps:
-- 1. Only the lease holder appends, so a worker that lost its lease cannot interleave pieces.
-- 2. Piece 0 starts the list again (a chunk made anew after a worker died or stopped).
-- 3. The piece is appended and the list given the TTL.
-- 4. {"event": "piece", "chunk", "n"} is published on each waiter's events channel.
if redis.call('GET', KEYS[2]) ~= ARGV[6] then return -1 end
if ARGV[3] == '0' then redis.call('DEL', KEYS[1]) end
local n = redis.call('RPUSH', KEYS[1], ARGV[4]) - 1
redis.call('EXPIRE', KEYS[1], ARGV[5])
local news = '{"event":"piece","chunk":"' .. ARGV[2] .. '","n":' .. n .. '}'
for _, r in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  redis.call('PUBLISH', ARGV[1] .. r, news)
end
return n
