-- retire.lua: forget the records whose retention is over (work/lifetime.py sweep).
-- KEYS: 1 the ledger of kept records (keys.RETAINED_KEY).
-- ARGV: 1 now (unix seconds), 2 how many records at most, 3... the prefixes of a record's keys
--       (keys.record_keys("")): a record's keys are met only as the script runs, so it is handed their prefixes.
-- Returns how many records it forgot.
-- Steps:
-- 1. The ledger's entries whose end is past, oldest first, at most ARGV[2] of them.
-- 2. Each one's keys are deleted, then its entry.
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  for i = 3, #ARGV do redis.call('DEL', ARGV[i] .. id) end
  redis.call('ZREM', KEYS[1], id)
end
return #ids
