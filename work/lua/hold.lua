-- hold.lua: keep a request's record while its RQ job is active (work/lifetime.py hold).
-- KEYS: 1 the RQ job's hash, 2 the ledger of kept records (keys.RETAINED_KEY), 3... the request's keys that
--       may carry a TTL (callback URLs).
-- ARGV: 1 the request id, 2... the RQ job statuses that count as active (work/status.ACTIVE; a retry waits as
--       "scheduled").
-- Returns 1 when the job is active (and the record is held), else 0.
-- Steps:
-- 1. The job's status, from its hash.
-- 2. If it is one of the active statuses, the ledger holds the record with no end (+inf) and every request key
--    loses its TTL.
-- Atomic with the worker's end of the job: either the job is still active when this runs (and
-- work/lifetime.release comes after), or it is over and nothing is held.
local status = redis.call('HGET', KEYS[1], 'status')
for i = 2, #ARGV do
  if status == ARGV[i] then
    redis.call('ZADD', KEYS[2], '+inf', ARGV[1])
    for k = 3, #KEYS do redis.call('PERSIST', KEYS[k]) end
    return 1
  end
end
return 0
