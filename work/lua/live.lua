-- live.lua: which of the chunks this worker makes are still worth making here (work/pool.py Pool.live).
-- KEYS: for each chunk, its task, then its claim.
-- ARGV: 1 this worker's token.
-- Returns per chunk 1 when it is live, else 0.
-- Steps:
-- 1. A chunk is live while its task is there (some request still needs it) and its claim is this worker's.
local out = {}
for i = 1, #KEYS, 2 do
  local live = redis.call('EXISTS', KEYS[i]) == 1 and redis.call('GET', KEYS[i + 1]) == ARGV[1]
  out[#out + 1] = live and 1 or 0
end
return out
