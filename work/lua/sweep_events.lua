-- sweep_events.lua: give up a tenant's webhook events whose retry window has passed without a try to end them
-- (their tries were lost), and forget its expired registrations (webhooks.py, each delivery process's upkeep).
-- Uses: sweep.lua
-- KEYS: 1 the tenant's pending set (member "e:<event id>" or "r:<registration>", scored by when it expires).
-- ARGV: 1 now (unix s), 2 the event key prefix (common/keys.event_key("")), 3 the state of a pending event,
--   4 the state of an event given up, 5 the TTL of an event given up (s).
-- Returns how many entries went.
-- Steps:
-- 1. The expired entries go; events among them still pending are given up (sweep.lua).
return sweep(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
