--[[ budget_ent_load.lua: write a user's entitlements (ent), loaded from the record of truth.

Writes only when ent has no epoch and this load's epoch is at least ent.want (the least
epoch an invalidation asked for), or when ent holds a smaller epoch; the whole hash is then
replaced, the grants' credit-report flags included (the record of truth keeps them). An
ent already at this very epoch is left as it is: a re-sent load (or a second loader of the
same epoch) changes nothing and succeeds.

A marked load (ARGV[6] = '1') writes only into an ent that exists: the loader marked it
(budget_ent_mark.lua) before it took its epoch and read the record of truth. An ent that
is gone by now was lost with the cache (FLUSHALL, a failover that dropped the last writes)
while the load ran, and with it any invalidation that an operator change made meanwhile:
the load is refused, and the caller loads again.

KEYS[1]  ent         hash: epoch, want, plan, susp, ng, g:<reference> (_budget_grants.lua)
ARGV[1]  epoch       this load's epoch (integer >= 1)
ARGV[2]  ttl_ms      expiry of ent, ms (integer >= 1)
ARGV[3]  plan        the operator's plan override; '' = none
ARGV[4]  susp        suspension end, ms since the epoch, 0 = until lifted; '' = none
ARGV[5]  grants      the live grants, one "<reference> <remaining> <expires_ms or 0> <kind>
                     <created_ms> <tokens>[ <flags>]" per line (may be empty); flags: the
                     credit reports already made, a subset of "lx"
ARGV[6]  marked      '1': write only into an existing ent (a marked load); '' otherwise

Returns {loaded, epoch}: loaded 1 when ent now holds this epoch (written now or already),
0 when refused (ent holds a newer epoch, or wants one); epoch = ent's epoch after the call
(0 = none).
]]
local ent_key = KEYS[1]

local epoch = tonumber(ARGV[1])
local ttl_ms = ARGV[2]
local plan = ARGV[3]
local susp = ARGV[4]
local grants = ARGV[5]
local marked = ARGV[6] == '1'

local entitled = true
--#include _budget_grants.lua  (entitlements and draws)

local current = G.load_ent(ent_key)
if marked and redis.call('EXISTS', ent_key) == 0 then return {0, 0} end
if current.epoch then
  if current.epoch == epoch then return {1, epoch} end
  if current.epoch > epoch then return {0, current.epoch} end
elseif current.want and epoch < current.want then
  return {0, 0}
end

local fields = {'epoch', string.format('%d', epoch)}
if plan ~= '' then
  fields[#fields + 1] = 'plan'
  fields[#fields + 1] = plan
end
if susp ~= '' then
  fields[#fields + 1] = 'susp'
  fields[#fields + 1] = susp
end
local ng = 0  -- the number of grants: a reservation of a user with none knows credit is 0
for line in string.gmatch(grants, '[^\n]+') do
  local ref, rem, exp, kind, created, tokens, flags = string.match(
    line, '^(%S+) (%d+) (%d+) (%a+) (%d+) (%d+) ?(%a*)$')
  if ref then
    local g = {ref = ref, remaining = tonumber(rem), expires = tonumber(exp), kind = kind,
               created = tonumber(created), tokens = tonumber(tokens), flags = flags}
    fields[#fields + 1] = 'g:' .. ref
    fields[#fields + 1] = G.more().grant_value(g)
    ng = ng + 1
  end
end
fields[#fields + 1] = 'ng'
fields[#fields + 1] = string.format('%d', ng)
redis.call('DEL', ent_key)
redis.call('HSET', ent_key, unpack(fields))
redis.call('PEXPIRE', ent_key, ttl_ms)
return {1, epoch}
