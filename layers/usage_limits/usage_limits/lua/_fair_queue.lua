--[[ _fair_queue.lua: a provider's fair queue, for throttle_acquire.lua and
throttle_confirm.lua. Not a script of its own: LuaScript pastes it where a script says
`--#include _fair_queue.lua`.

Start-time fair queuing (SFQ) over the GCRA bucket. A request that cannot book a slot at once
waits in `queue` under its start tag S = max(V, F_user), and its user's finish tag becomes
F_user = S + cost / weight. V (`vt` in the state hash) is the start tag of the last request
booked. Only the queue's head (lowest tag; equal tags in arrival order, as entry names are
zero-padded arrival numbers) books a slot, and only one at most `horizon_ms` ahead of its
caller's clock; the others are told the slot they would get if every entry ahead of them
booked next (a lower bound: a later arrival with a lower tag moves them back) and ask again
then. An entry expires at min(its deadline, its told slot + grace_ms): a waiter that died
leaves the queue by itself.

Keys (all share the provider's hash tag):
  queue    sorted set: entry -> start tag
  entries  hash: entry -> "<cost> <deadline_ms> <told_ms> <user>" (told: its last told slot)
  expiry   sorted set: entry -> when it leaves the queue unless it asks again, ms
  users    sorted set: user -> finish tag F_user (F_user <= V means "no backlog": removed)
]]

local function fmt(x) return string.format('%.3f', x) end
local function fmt_up(x) return string.format('%.3f', math.ceil(x * 1000) / 1000) end
local function tag_text(x) return string.format('%.17g', x) end

-- Take an entry out of the queue (booked, refused, or expired).
local function fq_remove(queue, entries, expiry, entry)
  redis.call('ZREM', queue, entry)
  redis.call('HDEL', entries, entry)
  redis.call('ZREM', expiry, entry)
end

-- Drop the entries whose expiry is at or before the clock (their callers died or gave up).
local function fq_purge(queue, entries, expiry, clock)
  local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', fmt(clock))
  for _, e in ipairs(gone) do fq_remove(queue, entries, expiry, e) end
end

-- Record what an entry was told (its slot) and when it leaves the queue unless it asks
-- again: min(its deadline, the told slot + grace_ms).
local function fq_tell(entries, expiry, entry, cost, deadline, slot, user, grace)
  redis.call('HSET', entries, entry,
             fmt(cost) .. ' ' .. fmt(deadline) .. ' ' .. fmt(slot) .. ' ' .. user)
  redis.call('ZADD', expiry, fmt(math.min(deadline, slot + grace)), entry)
end

-- Cost units queued ahead of a start tag: every entry with a lower tag, and with an equal tag
-- an entry named before `entry` (nil: every entry with an equal tag, as for a new arrival).
-- An entry told a slot before `late` (its caller has not come back for it: descheduled, or
-- dead) is passed over: the slot goes to the next, and it books the one after when it asks.
local function fq_ahead(queue, entries, tag, entry, late)
  local ahead = 0
  local found = redis.call('ZRANGEBYSCORE', queue, '-inf', tag_text(tag), 'WITHSCORES')
  for i = 1, #found, 2 do
    local e, s = found[i], tonumber(found[i + 1])
    if s < tag or entry == nil or e < entry then
      local cost, told = string.match(redis.call('HGET', entries, e), '^(%S+) %S+ (%S+) ')
      if tonumber(told) >= late then ahead = ahead + tonumber(cost) end
    end
  end
  return ahead
end

-- The slot a request gets when `units` cost units (its own included) book from the state
-- now: GCRA, as if every one of them booked at once.
local function fq_slot(tat, clock, pause, interval, burst, units)
  local base = math.max(tat, clock, pause)
  return math.max(clock, pause, base + units * interval - burst * interval)
end

-- Every key of the provider lives until its state is equivalent to a fresh key (the clock
-- past tat and pause, and no queued entry left), plus 1 s.
local function fq_expire(keys, clock, tat, pause, expiry)
  local last = redis.call('ZRANGE', expiry, -1, -1, 'WITHSCORES')
  local until_ms = math.max(tat, pause, tonumber(last[2]) or 0)
  -- At least 1 s: a PEXPIRE of 0 or less would delete the keys at once.
  local ttl = math.max(0, math.ceil(until_ms - clock)) + 1000
  for _, k in ipairs(keys) do redis.call('PEXPIRE', k, ttl) end
end
