-- register_hook.lua: keep a tenant's callback URL for a request's event, up to the tenant's limits
-- (web/callbacks.py register).
-- Uses: sweep.lua
-- KEYS: 1 the request's hooks (a hash: field = tenant's prefix + URL, value = the event's format),
--   2 the tenant's pending set (member "e:<event id>" or "r:<registration>", scored by when it expires).
-- ARGV: 1 field, 2 format, 3 limit (URLs a tenant may have on the request), 4 ttl (s), 5 the tenant's field prefix,
--   6 now (unix s), 7 the most entries the tenant's pending set may hold, 8 this registration's pending member,
--   9 the event key prefix (common/keys.event_key("")), 10 the state of a pending event, 11 the state of an event
--   given up, 12 the TTL of an event given up (s).
-- Returns 0 when the tenant has `limit` other URLs on the request already, -1 when it has its most pending events,
-- 2 when the field is new, 1 when it was registered already.
-- Steps:
-- 1. A field registered already is kept as it is.
-- 2. A new field: the tenant's fields are counted; at the limit nothing is written (0).
-- 3. The tenant's pending set is swept of what expired (sweep.lua); at its most nothing is written (-1).
-- 4. Below both the field is written and entered in the pending set, to expire with the hash.
-- 5. The hash's TTL is set anew.
local added = 1
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  local mine = 0
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(field, 1, #ARGV[5]) == ARGV[5] then mine = mine + 1 end
  end
  if mine >= tonumber(ARGV[3]) then return 0 end
  local now = tonumber(ARGV[6])
  sweep(KEYS[2], now, ARGV[9], ARGV[10], ARGV[11], ARGV[12])
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[7]) then return -1 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[8])
  added = 2
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return added
