-- hold.lua: make a request's keys persistent while its RQ job is active (work/lifetime.py hold).
-- KEYS: 1 the RQ job's hash, 2... the request's keys (manifest, callback URLs, tenants).
-- ARGV: the RQ job statuses that count as active (work/status.ACTIVE; a retry waits as "scheduled").
-- Returns 1 when the job is active (and the keys were made persistent), else 0.
-- Steps:
-- 1. The job's status, from its hash.
-- 2. If it is one of the active statuses, every request key loses its TTL.
-- Atomic with the worker's end of the job: either the job is still active when this runs (and
-- work/lifetime.release comes after), or it is over and nothing is made persistent.
local status = redis.call('HGET', KEYS[1], 'status')
for _, active in ipairs(ARGV) do
  if status == active then
    for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
    return 1
  end
end
return 0
