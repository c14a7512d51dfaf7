-- claim.lua: lease up to n open chunks that can share one model call, in fair order (work/pool.py Pool.claim).
-- Uses: forget.lua
-- KEYS: 1 pool (its own lane), 2 turns.
-- ARGV: 1 one JSON table, its fields named as in work/pool.py ClaimArgs: rows (n wanted), lease_ms,
--   token, cross (bool), scan_limit, slot, own (request id, '' for none), own_chunks (its chunk ids in
--   request order), share, firsts (rows past these are first chunks only), and prefixes {lane, claim,
--   task, waiters, chunk, events}.
-- The prefixes (common/keys.py: lane_prefix, and each key function called with ""): which tenants have a
-- lane and which chunks the scan meets are found only as the script runs, so their keys are a prefix and
-- the tenant's name or the chunk's id. This is why the pool needs one Redis, not a Cluster.
-- Returns (chunk id, spec, pool score) per chunk taken, then '1' when open work was left, else '0'.
-- Steps:
-- 1. The lanes in turn: each tenant's listed in the turns, the one served least recently first; the
--    pool's own lane is always one.
-- 2. Share: with `share` workers free to take the pool's work (this one and idle ones), n shrinks to this
--    worker's share of what is open, so that one request is spread over all of them.
-- 3. Own: the claiming request's earliest open chunk comes first, so its job makes progress with every
--    batch and keeps to its time limit.
-- 4. The rest from the lanes in turn, one row each, each lane in its fair order (every request's chunk 0,
--    then every chunk 1...); a tenant served moves to the back of the turns.
-- 5. Whether open work is left that another worker could take.
-- 6. Tidying what the scan met: entries of chunks already stored are forgotten (their requests woken),
--    entries without a task removed, and tenants whose lane is empty leave the turns.
local pool, turns = KEYS[1], KEYS[2]
local a = cjson.decode(ARGV[1])
local n, lease, token, cross, limit = a.rows, a.lease_ms, a.token, a.cross, a.scan_limit
local slot, own, own_chunks, share, firsts = a.slot, a.own, a.own_chunks, a.share, a.firsts
local p = a.prefixes
local lanep, claimp, taskp, waitersp, chunkp, events = p.lane, p.claim, p.task, p.waiters, p.chunk, p.events
local t = redis.call('TIME')
local now = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) % slot
local out, taken, stale, orphans = {}, {}, {}, {}
local batch, only, more, rows = nil, nil, 0, 0

-- 1. The lanes in turn.
local lanes, listed = {}, false
for _, tenant in ipairs(redis.call('ZRANGE', turns, 0, -1)) do
  if tenant == '' then listed = true end
  lanes[#lanes + 1] = {tenant = tenant, key = tenant == '' and pool or lanep .. tenant, pos = 0, buf = {}, i = 1}
end
if not listed then lanes[#lanes + 1] = {tenant = '', key = pool, pos = 0, buf = {}, i = 1} end
local served = tonumber(redis.call('ZREVRANGE', turns, 0, 0, 'WITHSCORES')[2] or '0')

-- Is chunk `cid` neither claimed nor stored?
local function unclaimed(cid)
  return redis.call('EXISTS', claimp .. cid) == 0 and redis.call('EXISTS', chunkp .. cid) == 0
end

-- The task of an unclaimed chunk that still needs making, or nil.
local function open(lane, member, cid)
  if redis.call('EXISTS', claimp .. cid) == 1 then return nil end
  if redis.call('EXISTS', chunkp .. cid) == 1 then stale[#stale + 1] = {lane, member, cid}; return nil end
  local task = redis.call('HMGET', taskp .. cid, 'batch', 'spec')
  if not task[1] then orphans[#orphans + 1] = {lane, member}; return nil end
  return task
end

-- Past `firsts` rows, only a request's first chunk (score below `slot`) is taken.
local function allowed(score) return rows < firsts or tonumber(score) < slot end

local function take(cid, task, request, score)
  redis.call('SET', claimp .. cid, token, 'PX', lease)
  out[#out + 1] = cid
  out[#out + 1] = task[2]
  out[#out + 1] = score
  taken[cid] = true
  rows = rows + 1
  batch = task[1]
  if not cross and only == nil then only = request end
end

-- A lane's next member in its order and its score, scanning at most `limit` of them; nil at its end.
local function following(lane)
  if lane.i > #lane.buf then
    if lane.pos >= limit then return nil end
    lane.buf, lane.i = redis.call('ZRANGE', lane.key, lane.pos, lane.pos + 99, 'WITHSCORES'), 1
    lane.pos = lane.pos + 100
    if #lane.buf == 0 then return nil end
  end
  lane.i = lane.i + 2
  return lane.buf[lane.i - 2], lane.buf[lane.i - 1]
end

-- A lane's next open chunk that fits this call: request, chunk id, task and score; nil when it has none.
-- Open chunks that do not fit are work left for another worker (`more`). Past `firsts` rows the lane
-- ends at its first later chunk: in score order nothing after it is a first chunk.
local function next_fit(lane)
  while true do
    local member, score = following(lane)
    if member == nil then return nil end
    local sep = string.find(member, ':', 1, true)
    local request, cid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
    if not taken[cid] then
      local task = open(lane.key, member, cid)
      if task then
        local fits = batch == nil or task[1] == batch
        if fits and only ~= nil and request ~= only then
          fits = redis.call('SISMEMBER', waitersp .. cid, only) == 1
        end
        if fits and allowed(score) then return request, cid, task, score end
        more = 1
        if not allowed(score) then return nil end
      end
    end
  end
end

-- 2. Share: count the open chunks, up to n * share of them, and take this worker's part.
local function take_share()
  local open_rows, counted = 0, {}
  for _, lane in ipairs(lanes) do
    local start = 0
    while start < limit and open_rows < n * share do
      local members = redis.call('ZRANGE', lane.key, start, start + 99)
      if #members == 0 then break end
      for _, member in ipairs(members) do
        local cid = string.sub(member, string.find(member, ':', 1, true) + 1)
        if not counted[cid] and unclaimed(cid) then
          counted[cid] = true
          open_rows = open_rows + 1
        end
      end
      start = start + 100
    end
  end
  n = math.max(1, math.min(n, math.ceil(open_rows / share)))
end

-- 3. Own: the first of the own chunks this request waits on that is open, placed by its score in
-- whichever lane holds it (in none, as a later chunk).
local function take_own()
  for _, cid in ipairs(own_chunks) do
    if not taken[cid] and redis.call('SISMEMBER', waitersp .. cid, own) == 1 then
      local member = own .. ':' .. cid
      local task = open(pool, member, cid)
      if task then
        local score = nil
        for _, lane in ipairs(lanes) do
          score = score or redis.call('ZSCORE', lane.key, member) or nil
        end
        score = score or tostring(slot)
        if allowed(score) then take(cid, task, own, score) end
        return
      end
    end
  end
end

-- 4. The rest, one row per lane in turn, until n rows or every lane is done.
local function take_in_turn()
  local active = #lanes
  while rows < n and active > 0 do
    for _, lane in ipairs(lanes) do
      if rows < n and not lane.done then
        local request, cid, task, score = next_fit(lane)
        if request then
          take(cid, task, request, score)
          served = served + 1
          redis.call('ZADD', turns, served, lane.tenant)
        else
          lane.done, active = true, active - 1
        end
      end
    end
  end
end

-- 6. Tidying.
local function tidy()
  for _, found in ipairs(stale) do
    redis.call('ZREM', found[1], found[2])
    forget(lanes_of(pool, turns, lanep), waitersp .. found[3], taskp .. found[3], found[3], events, slot, now)
  end
  for _, found in ipairs(orphans) do redis.call('ZREM', found[1], found[2]) end
  for _, lane in ipairs(lanes) do
    if lane.done and redis.call('EXISTS', lane.key) == 0 then redis.call('ZREM', turns, lane.tenant) end
  end
end

if share > 1 then take_share() end
if own ~= '' then take_own() end
take_in_turn()
-- 5. Open work left.
for _, lane in ipairs(lanes) do
  if more == 0 and not lane.done and next_fit(lane) then more = 1 end
end
tidy()
out[#out + 1] = tostring(more)
return out
