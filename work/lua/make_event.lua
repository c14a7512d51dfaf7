-- make_event.lua: make the webhook event of one callback of a request, unless the callback has had its event for
-- this outcome already (hooks/events.py enqueue).
-- Uses: sweep.lua
-- KEYS: 1 the request's deliveries (a hash: callback field -> event id), 2 the new event's hash, 3 the tenant's
--   pending set (member "e:<event id>" or "r:<registration>", scored by when it expires).
-- ARGV: 1 the callback's field, 2 the new event's id, 3 its outcome, 4 the event key prefix
--   (common/keys.event_key("")), 5 the callback URL, 6 the body, 7 when it was made (unix s), 8 the tenant,
--   9 the deliveries' TTL (s), 10 the registration's pending member, 11 the event's pending member, 12 when the
--   event expires (unix s), 13 now, 14 the state of a pending event, 15 the state of an event given up,
--   16 the TTL of an event given up (s).
-- Returns {event id, 1} for an event to queue: the new one, or the callback's earlier one of this outcome whose
-- queueing did not finish; {event id, 0} when the earlier one of this outcome was queued.
-- Steps:
-- 1. The tenant's pending set is swept of what expired (sweep.lua), and the registration leaves it either way.
-- 2. The callback's earlier event with this outcome, when there is one, is the answer; nothing is written.
-- 3. Else the event is written, named in the request's deliveries, and entered in the tenant's pending set.
sweep(KEYS[3], ARGV[13], ARGV[4], ARGV[14], ARGV[15], ARGV[16])
redis.call('ZREM', KEYS[3], ARGV[10])
local earlier = redis.call('HGET', KEYS[1], ARGV[1])
if earlier then
  local found = redis.call('HMGET', ARGV[4] .. earlier, 'status', 'enqueued')
  if found[1] == ARGV[3] then
    if found[2] then return {earlier, 0} end
    return {earlier, 1}
  end
end
redis.call('HSET', KEYS[2], 'url', ARGV[5], 'body', ARGV[6], 'created', ARGV[7], 'state', ARGV[14],
  'status', ARGV[3], 'tenant', ARGV[8])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[9])
redis.call('ZADD', KEYS[3], ARGV[12], ARGV[11])
return {ARGV[2], 1}
