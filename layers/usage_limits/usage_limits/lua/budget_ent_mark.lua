--[[ budget_ent_mark.lua: mark a user's ent before a load of it begins.

A load takes a new epoch in the record of truth, reads the user's entitlements and writes
the copy (budget_ent_load.lua, marked). It marks ent first: when ent is gone by the time
the copy is written, the cache lost its data while the load ran (and with it any
invalidation an operator change made meanwhile), and the copy may be older than the record
of truth: the load is refused. An ent that exists (a copy, an invalidation marker, another
loader's mark) is left as it is; an absent one becomes {want = 0}, which the hot path reads
as "not loaded". Running it twice changes nothing more.

KEYS[1]  ent         hash: epoch, want, plan, susp, g:<reference> (see _budget_grants.lua)
ARGV[1]  ttl_ms      expiry of a new mark, ms (integer >= 1)

Returns 1 when the mark was made now, 0 when ent existed.
]]
local ent_key = KEYS[1]
local ttl_ms = ARGV[1]

if redis.call('EXISTS', ent_key) == 1 then return 0 end
redis.call('HSET', ent_key, 'want', '0')
redis.call('PEXPIRE', ent_key, ttl_ms)
return 1
