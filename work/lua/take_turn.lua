-- take_turn.lua: a delivery process claims the webhook try it took from a lane, unless the lane or the lane's
-- tenant holds its share of the delivery processes already (hooks/lanes.py Turns.take).
-- KEYS: 1 busy (a sorted set: member "<worker>|<tenant>|<lane>" per try held, scored by when its claim lapses),
--   2 turns (a hash: lane -> the unix time a try was last taken from it).
-- ARGV: 1 now (unix seconds), 2 when this claim lapses, 3 the worker's name, 4 the tenant, 5 the lane,
--   6 the tenant's share, 7 the lane's share (processes).
-- Returns 1 when claimed, 0 when the tenant or the lane holds its share already (nothing is written).
-- Steps:
-- 1. Claims that lapsed (their process died) are dropped, and this worker's own earlier claim.
-- 2. The claims of the tenant and of the lane are counted; at either share nothing is written (0).
-- 3. The claim is written and the lane's turn recorded.
local busy, turns = KEYS[1], KEYS[2]
local now, lapse, worker, tenant, lane = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local tenant_share, lane_share = tonumber(ARGV[6]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', busy, '-inf', now)
local mine, of_tenant, of_lane = worker .. '|', 0, 0
for _, member in ipairs(redis.call('ZRANGE', busy, 0, -1)) do
  if string.sub(member, 1, #mine) == mine then
    redis.call('ZREM', busy, member)
  else
    local rest = string.sub(member, string.find(member, '|', 1, true) + 1)
    local bar = string.find(rest, '|', 1, true)
    if string.sub(rest, 1, bar - 1) == tenant then of_tenant = of_tenant + 1 end
    if string.sub(rest, bar + 1) == lane then of_lane = of_lane + 1 end
  end
end
if of_tenant >= tenant_share or of_lane >= lane_share then return 0 end
redis.call('ZADD', busy, lapse, mine .. tenant .. '|' .. lane)
redis.call('HSET', turns, lane, now)
return 1
