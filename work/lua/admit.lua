-- admit.lua: may a tenant add chunks to the pool? The queue's limit, shared by the tenants that wait
-- (work/queueing.py admit).
-- KEYS: 1 the pool (its own lane), 2 the turns (the tenants with a lane).
-- ARGV: 1 the lane prefix (common/keys.lane_prefix), 2 the tenant ("" without named keys), 3 the chunks it
--       would add, 4 the limit (TTS_MAX_QUEUE, chunks waiting).
-- The lane prefix: the tenants with a lane are read from KEYS[2] as the script runs, so their lanes' keys are
-- that prefix and the tenant's name.
-- Returns {1 when admitted else 0, the tenant's chunks waiting, its share, all chunks waiting}.
-- Steps:
-- 1. The chunks waiting in each lane (the pool's own, then each tenant's).
-- 2. The tenants waiting: those with chunks in their lane, the one asking counted too.
-- 3. Its share: the limit divided among them (rounded up).
-- 4. Admitted while its own chunks stay within its share (alone, the whole limit), or when nothing waits at all.
local pool, turns = KEYS[1], KEYS[2]
local lanep, tenant, adding, limit = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])

local total, mine, waiting = 0, 0, 0
local names = redis.call('ZRANGE', turns, 0, -1)
names[#names + 1] = ''
local seen = {}
for _, name in ipairs(names) do
  if not seen[name] then
    seen[name] = true
    local size = redis.call('ZCARD', name == '' and pool or lanep .. name)
    total = total + size
    if name == tenant then mine = size end
    if size > 0 and name ~= tenant then waiting = waiting + 1 end
  end
end
local share = math.ceil(limit / (waiting + 1))
local admitted = (mine + adding <= share or total == 0) and 1 or 0
return {admitted, mine, share, total}
