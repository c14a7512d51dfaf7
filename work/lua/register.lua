-- register.lua: put a request's chunks whose audio is not stored in the pool (work/pool.py Pool.register).
-- KEYS: 1 pool (its own lane), 2 metrics counters, 3 turns, 4 the request's tenants,
--   then (chunk, task, waiters) per chunk.
-- ARGV: 1 request, 2 ttl (s), 3 counter field, 4 slot, 5 lane prefix (common/keys.lane_prefix),
--   then (chunk id, index, batch, spec) per chunk.
-- The lane prefix: which tenants want the request is read from KEYS[4] as the script runs, so their lanes'
-- keys are that prefix and the tenant's name.
-- Returns how many chunks became new tasks.
-- Steps:
-- 1. The arrival time, from Redis's clock (milliseconds modulo the slot).
-- 2. The lanes of the tenants that want the request (the pool's own without any) join the turns.
-- 3. Each chunk not stored gets its task (if new), the request as a waiter, both with the TTL, and an
--    entry in each of those lanes scored index * slot + arrival.
-- 4. New tasks are added to the chunks-needed counter.
local pool, counters, turns = KEYS[1], KEYS[2], KEYS[3]
local r, ttl, needed, slot, lanep = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5]

local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot

local lanes = {}
local tenants = redis.call('SMEMBERS', KEYS[4])
if #tenants == 0 then tenants = {''} end
for _, tenant in ipairs(tenants) do
  lanes[#lanes + 1] = tenant == '' and pool or lanep .. tenant
  redis.call('ZADD', turns, 'NX', 0, tenant)
end

local new = 0
for c = 0, (#KEYS - 4) / 3 - 1 do
  local chunk, task, w = KEYS[5 + 3 * c], KEYS[6 + 3 * c], KEYS[7 + 3 * c]
  local a = 6 + 4 * c
  local cid = ARGV[a]
  if redis.call('EXISTS', chunk) == 0 then
    if redis.call('EXISTS', task) == 0 then
      redis.call('HSET', task, 'batch', ARGV[a + 2], 'spec', ARGV[a + 3])
      new = new + 1
    end
    redis.call('EXPIRE', task, ttl)
    redis.call('SADD', w, r)
    redis.call('EXPIRE', w, ttl)
    local score = string.format('%.0f', tonumber(ARGV[a + 1]) * slot + now)
    for _, lane in ipairs(lanes) do redis.call('ZADD', lane, 'NX', score, r .. ':' .. cid) end
  end
end

if new > 0 then redis.call('HINCRBYFLOAT', counters, needed, new) end
return new
