-- forget.lua: a library (no KEYS or ARGV of its own) for the scripts that end a chunk's life in the pool
-- (complete.lua, fail.lua, withdraw.lua, claim.lua); work/scripts.py puts it before them.
-- Its functions, in the order a script calls them:
-- 1. lanes_of(pool, turns, lanep): every lane of the pool, its own then each tenant's listed in the turns;
--    a tenant's lane key is the lane prefix (common/keys.lane_prefix, handed in ARGV) and its name, as the
--    tenants are known only from the turns as the script runs.
-- 2. forget(lanes, w, task, cid, events, slot, now): take the chunk out of every lane for each request
--    waiting on it, wake each of those requests on its events channel (events prefix and request id), drop
--    its waiters and task. Returns, for each waiter whose chunk 0 this was, the request id and the
--    milliseconds since it arrived.

local function lanes_of(pool, turns, lanep)
  local out = {pool}
  for _, tenant in ipairs(redis.call('ZRANGE', turns, 0, -1)) do
    if tenant ~= '' then out[#out + 1] = lanep .. tenant end
  end
  return out
end

local function forget(lanes, w, task, cid, events, slot, now)
  local firsts = {}
  for _, r in ipairs(redis.call('SMEMBERS', w)) do
    local member = r .. ':' .. cid
    local first = nil
    for _, lane in ipairs(lanes) do
      local score = redis.call('ZSCORE', lane, member)
      if score then
        score = tonumber(score)
        if score < slot and first == nil then first = score end
        redis.call('ZREM', lane, member)
      end
    end
    if first then
      firsts[#firsts + 1] = r
      firsts[#firsts + 1] = tostring((now - first) % slot)
    end
    redis.call('PUBLISH', events .. r, '{"event":"chunk"}')
  end
  redis.call('DEL', w, task)
  return firsts
end
