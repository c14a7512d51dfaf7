-- look.lua: what a request's run reads at each look, in one round trip (work/scheduler.py Pool.look).
-- KEYS: 1 the request's cancel mark, then for each chunk still missing: its audio, its failed mark.
-- ARGV: none.
-- Returns {1 when canceled else 0, then per chunk: 1 when its audio is stored else 0, why it failed or nil}.
-- Steps:
-- 1. Whether the request was canceled.
-- 2. Per chunk, whether its audio is stored and its failure mark, read together.
local out = {redis.call('EXISTS', KEYS[1])}
for i = 2, #KEYS, 2 do
  out[#out + 1] = redis.call('EXISTS', KEYS[i])
  out[#out + 1] = redis.call('GET', KEYS[i + 1])
end
return out
