--[[ throttle_lease_acquire.lua: take an in-flight lease of a provider, in arrival order.

A leased semaphore: every holder has a lease that expires on its own, so a holder that is
killed (kill -9, a Lambda timeout) frees its place after lease_ms without running any code.
Callers that cannot have a lease yet wait in a queue ordered by arrival (a ticket); a caller
is granted only when it is among the first `free` queued callers, so nobody overtakes. A
queued caller must come back (call again) before its queue entry expires, so a dead waiter
blocks nobody for longer than waiter_ttl_ms.

Clock: every expiry is set and compared on the provider's lease clock (_lease_clock.lua):
the server's clock, never running back, with the caller's clock trusted only within
trust_ms of it (the library sends 0). A caller whose clock runs ahead or behind, by any
amount, moves no lease's expiry by more than trust_ms.

Idempotent per call: a caller that holds a live lease is answered "granted" again (redis-py
re-sends a script whose reply was lost; the caller must not queue behind its own lease), and
an id that was released (or gave up waiting) is never granted again (a call held up in the
network that arrives after the caller left must not leak a lease).

KEYS[1]  leases    zset: lease id -> lease expiry, ms on the shared clock
KEYS[2]  waiters   zset: lease id -> ticket (arrival order)
KEYS[3]  wexpiry   zset: lease id -> queue entry expiry, ms on the shared clock
KEYS[4]  clock     string: the shared lease clock, ms since the epoch
KEYS[5]  released  zset: released lease id -> tombstone expiry, ms (see throttle_lease_release)
ARGV[1]  now_ms         caller's clock, ms since the epoch (float)
ARGV[2]  limit          max_concurrency: leases that may be held at once (>= 1)
ARGV[3]  lease_ms       lease length, ms
ARGV[4]  id             the caller's lease id (random; the same on every call of one wait)
ARGV[5]  waiter_ttl_ms  how long a queue entry lives without the caller coming back, ms
ARGV[6]  queue          1: join (or stay in) the queue when not granted; 0: try only
ARGV[7]  trust_ms       how far the caller's clock is trusted from the server's, ms
                        (absent: 0, the server's clock alone)

Returns {granted, rank, free, expiry_ms, clock_ms}:
  granted    1 when the lease is held (the caller holds it until released or expired)
  rank       0-based place in the queue (-1 when not queued)
  free       leases free now (limit minus live leases; may be <= 0)
  expiry_ms  (string) when to check again at the latest, on the shared clock: enough live
             leases will have expired for this caller's turn, or a queue entry expires;
             "" when not known
  clock_ms   (string) the lease clock this call ran at: a wait is expiry_ms - clock_ms
]]
local leases, waiters, wexpiry, clock_key, released = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local limit = tonumber(ARGV[2])
local lease_ms = tonumber(ARGV[3])
local id = ARGV[4]
local waiter_ttl = tonumber(ARGV[5])
local queue = ARGV[6] == '1'

--#include _lease_clock.lua  (the lease clock)

-- Keys expire after their newest entry; never shorten a longer expiry.
local function keep(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end

local now = lease_clock_now(clock_key, ARGV[1], ARGV[7])
local at = string.format('%.3f', now)
redis.call('SET', clock_key, at, 'KEEPTTL')
keep(clock_key, math.ceil(math.max(lease_ms, waiter_ttl)) + 1000)

-- Expired leases (dead holders), expired queue entries (dead waiters) and old tombstones.
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
redis.call('ZREMRANGEBYSCORE', released, '-inf', now)
local dead = redis.call('ZRANGEBYSCORE', wexpiry, '-inf', now, 'LIMIT', 0, 1000)
if #dead > 0 then
  redis.call('ZREM', waiters, unpack(dead))
  redis.call('ZREM', wexpiry, unpack(dead))
end

local held = redis.call('ZCARD', leases)
local free = limit - held
if redis.call('ZSCORE', leases, id) then
  return {1, -1, free, '', at}  -- this call ran before: the caller holds its lease
end
if redis.call('ZSCORE', released, id) then
  return {0, -1, free, '', at}  -- the caller released this id and left: nothing to grant
end

local rank = redis.call('ZRANK', waiters, id)
if not rank then
  -- A new arrival queues behind everyone already waiting.
  rank = redis.call('ZCARD', waiters)
  if rank >= free and queue then
    local last = redis.call('ZRANGE', waiters, -1, -1, 'WITHSCORES')
    local ticket = 1
    if last[2] then ticket = tonumber(last[2]) + 1 end
    redis.call('ZADD', waiters, ticket, id)
  end
end

if rank < free then
  redis.call('ZREM', waiters, id)
  redis.call('ZREM', wexpiry, id)
  redis.call('ZADD', leases, now + lease_ms, id)
  keep(leases, math.ceil(lease_ms) + 1000)
  return {1, -1, free - 1, '', at}
end

if not queue then
  return {0, -1, free, '', at}
end

redis.call('ZADD', wexpiry, now + waiter_ttl, id)
keep(waiters, math.ceil(waiter_ttl) + 1000)
keep(wexpiry, math.ceil(waiter_ttl) + 1000)
-- This caller needs (rank - free + 1) more places; the leases that expire first give them
-- at the latest. A queue entry that expires first (a dead waiter ahead) may move it up.
local need = rank - free + 1
local expiry = nil
if held > 0 then
  local nth = redis.call('ZRANGE', leases, math.min(need, held) - 1, math.min(need, held) - 1,
                         'WITHSCORES')
  if nth[2] then expiry = tonumber(nth[2]) end
end
local first = redis.call('ZRANGE', wexpiry, 0, 0, 'WITHSCORES')
if first[2] and first[1] ~= id and (expiry == nil or tonumber(first[2]) < expiry) then
  expiry = tonumber(first[2])
end
if expiry == nil then return {0, rank, free, '', at} end
return {0, rank, free, string.format('%.3f', expiry), at}
