-- register_hook.lua: keep a tenant's callback URL for a request's event, up to the tenant's limit
-- (web/callbacks.py register).
-- KEYS: 1 the request's hooks (a hash: field = tenant's prefix + URL, value = the event's format).
-- ARGV: 1 field, 2 format, 3 limit (URLs a tenant may have on the request), 4 ttl (s), 5 the tenant's field prefix.
-- Returns 0 when the tenant has `limit` other URLs on the request already, 2 when the field is new,
-- 1 when it was registered already.
-- Steps:
-- 1. A field registered already is kept as it is.
-- 2. A new field: the tenant's fields are counted; at the limit nothing is written (0).
-- 3. Below it the field is written.
-- 4. The hash's TTL is set anew.
local added = 1
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  local mine = 0
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(field, 1, #ARGV[5]) == ARGV[5] then mine = mine + 1 end
  end
  if mine >= tonumber(ARGV[3]) then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  added = 2
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return added
