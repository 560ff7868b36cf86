--[[ _lease_clock.lua: the provider's lease clock, for throttle_lease_acquire.lua and
throttle_lease_release.lua. Not a script of its own: LuaScript pastes it where a script says
`--#include _lease_clock.lua`.

The clock is the server's (TIME; scripts are replicated by their effects on Redis 7 and
Valkey 8, so TIME is allowed), with the caller's clock trusted only within `trust_ms` of it:
the caller's time is clamped into [server - trust_ms, server + trust_ms] (the library sends
0, so the server's clock alone decides). The result never runs back: it is the latest of
that time and the clock stored in `clock_key` (a promoted replica whose clock runs behind
the old primary's keeps the old clock until its own passes it).

So a caller's clock moves a lease's expiry by at most trust_ms, however far it runs ahead
or behind: a lease lives between lease_ms - 2 * trust_ms and lease_ms + 2 * trust_ms of the
server's time (plus, after a failover, how far the new primary's clock runs behind).
]]

-- The lease clock now, ms since the epoch (float), from the caller's time and its trust.
-- A server that refuses TIME in scripts (reported of some managed services) leaves the
-- caller's clock unbounded, as it was before this bound: the latest caller time seen.
local function lease_clock_now(clock_key, caller_ms, trust_ms)
  local caller = tonumber(caller_ms)
  local ok, t = pcall(redis.call, 'TIME')
  if ok then
    local server = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
    local trust = math.max(0, tonumber(trust_ms) or 0)
    caller = math.min(math.max(caller, server - trust), server + trust)
  end
  return math.max(tonumber(redis.call('GET', clock_key)) or 0, caller)
end
