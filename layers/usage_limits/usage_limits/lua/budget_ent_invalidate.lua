--[[ budget_ent_invalidate.lua: mark a user's entitlements stale after a change of record.

ent becomes {want = epoch}: the hot path answers "not loaded" until a load of at least that
epoch. An ent already at this epoch or a newer one (loaded after the change), or already
wanting at least this epoch, is left alone: running it twice changes nothing more.

KEYS[1]  ent         hash: epoch, want, plan, susp, g:<reference> (see _budget_grants.lua)
ARGV[1]  epoch       the epoch of the change (integer >= 1)
ARGV[2]  ttl_ms      expiry of the marker, ms (integer >= 1)

Returns 1 when ent was replaced by the marker, 0 when left alone.
]]
local ent_key = KEYS[1]

local epoch = tonumber(ARGV[1])
local ttl_ms = ARGV[2]

local state = redis.call('HMGET', ent_key, 'epoch', 'want')
local current, want = tonumber(state[1]), tonumber(state[2])
if current and current >= epoch then return 0 end
if not current and want and want >= epoch then return 0 end
redis.call('DEL', ent_key)
redis.call('HSET', ent_key, 'want', string.format('%d', epoch))
redis.call('PEXPIRE', ent_key, ttl_ms)
return 1
