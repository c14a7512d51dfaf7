-- sweep.lua: a library (no KEYS or ARGV of its own) for the scripts that count or add to a tenant's pending webhook
-- events (register_hook.lua, make_event.lua, sweep_events.lua); work/scripts.py puts it before them.
-- Its functions, in the order a script calls them:
-- 1. sweep(pending, now, eventp, pending_state, given_up_state, given_up_ttl): drop the entries of the tenant's
--    pending set whose time is past; an event among them still pending (its delivery tries were lost) is given up:
--    its state set, its body dropped, and the TTL of an event that is over set. An event's key is the event key
--    prefix (common/keys.event_key(""), handed in ARGV) and its id, as the events are known only from the set.
--    Returns how many entries went.

local function sweep(pending, now, eventp, pending_state, given_up_state, given_up_ttl)
  local expired = redis.call('ZRANGEBYSCORE', pending, '-inf', now)
  for _, member in ipairs(expired) do
    if string.sub(member, 1, 2) == 'e:' then
      local event = eventp .. string.sub(member, 3)
      if redis.call('HGET', event, 'state') == pending_state then
        redis.call('HSET', event, 'state', given_up_state)
        redis.call('HDEL', event, 'body')
        redis.call('EXPIRE', event, given_up_ttl)
      end
    end
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', pending, '-inf', now) end
  return #expired
end
