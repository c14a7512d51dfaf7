-- store.lua: store finished chunks' audio and drop their streamed pieces (work/pool.py Pool.store).
-- KEYS: (chunk, task, pieces) per chunk. ARGV: 1 ttl (s), then each chunk's PCM16 audio.
-- Returns 1.
-- Steps, per chunk:
-- 1. Store the audio.
-- 2. Keep it persistent while a request still waits for it (its task exists: that request's end gives it
--    the TTL, work/lifetime.release); else start the TTL now (nobody's end will).
-- 3. Drop its streamed pieces, which the stored audio replaces byte for byte.
for c = 0, #KEYS / 3 - 1 do
  local chunk, task, pieces = KEYS[1 + 3 * c], KEYS[2 + 3 * c], KEYS[3 + 3 * c]
  redis.call('SET', chunk, ARGV[2 + c])
  if redis.call('EXISTS', task) == 0 then redis.call('EXPIRE', chunk, ARGV[1]) end
  redis.call('DEL', pieces)
end
return 1
