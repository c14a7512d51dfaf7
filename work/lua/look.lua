-- look.lua: what a request's run reads at each look, in one round trip (work/pool.py Pool.look).
-- KEYS: 1 the request's cancel mark, then for each chunk it misses: its audio, its failed mark; then for each
-- chunk in the worker's loop: its task, its claim.
-- ARGV: 1 how many chunks the request misses, 2 the worker's token.
-- Returns {1 when canceled else 0, then per missing chunk: 1 when its audio is stored else 0, why it failed
-- or nil; then per chunk in the loop: 1 when live else 0 (as live.lua)}.
-- Steps:
-- 1. Whether the request was canceled.
-- 2. Per missing chunk, whether its audio is stored and its failure mark, read together.
-- 3. Per chunk in the loop, whether some request still needs it and its claim is this worker's.
local out = {redis.call('EXISTS', KEYS[1])}
local held = 2 + 2 * tonumber(ARGV[1])
for i = 2, held - 1, 2 do
  out[#out + 1] = redis.call('EXISTS', KEYS[i])
  out[#out + 1] = redis.call('GET', KEYS[i + 1])
end
for i = held, #KEYS, 2 do
  local live = redis.call('EXISTS', KEYS[i]) == 1 and redis.call('GET', KEYS[i + 1]) == ARGV[2]
  out[#out + 1] = live and 1 or 0
end
return out
