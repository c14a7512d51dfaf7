-- save_voice.lua: save a tenant's voice unless its registry is full (web/voices.py save).
-- KEYS: 1 the tenant's voice registry (a hash: name = record JSON).
-- ARGV: 1 name, 2 record (JSON), 3 limit (voices a registry holds).
-- Returns {1, record} when it replaced a voice, {0, record} when the name is new, {-1, ''} when the registry is full.
-- Steps:
-- 1. The voice saved under the name, if any, is read.
-- 2. A new name in a full registry: nothing is written (-1).
-- 3. A replaced voice keeps its first save's `created`.
-- 4. The record is written.
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return {-1, ''} end
local record = ARGV[2]
if old then
  local fresh = cjson.decode(record)
  fresh['created'] = cjson.decode(old)['created']
  record = cjson.encode(fresh)
end
redis.call('HSET', KEYS[1], ARGV[1], record)
return {old and 1 or 0, record}
