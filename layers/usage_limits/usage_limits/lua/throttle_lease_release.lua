--[[ throttle_lease_release.lua: give back a lease, or leave the queue, and wake the waiters.

Removes the id from the leases and from the queue (a caller that gives up waiting calls this
too) and leaves a tombstone for lease_ms, so that an acquire of this id that arrives late
(held up in the network past the caller's socket timeout) grants nothing. When that can let a
queued caller in, publishes on the wake-up channel; waiters treat the message as a hint only
and re-check with throttle_lease_acquire.lua.

Idempotent per call: the tombstone keeps the answer, so the same call run again (a re-sent
script) answers what the first one did and changes nothing.

KEYS[1]  leases    zset: lease id -> lease expiry, ms on the shared clock
KEYS[2]  waiters   zset: lease id -> ticket
KEYS[3]  wexpiry   zset: lease id -> queue entry expiry, ms on the shared clock
KEYS[4]  clock     string: the shared lease clock, ms (see throttle_lease_acquire.lua)
KEYS[5]  released  zset: lease id -> tombstone expiry in whole ms on the shared clock, plus
                   0.5 when that release freed a live lease (its answer)
ARGV[1]  id        the lease id
ARGV[2]  channel   pub/sub channel of the provider's wake-ups
ARGV[3]  now_ms    caller's clock, ms since the epoch (float)
ARGV[4]  lease_ms  lease length, ms (how long the tombstone is kept)
ARGV[5]  trust_ms  how far the caller's clock is trusted from the server's, ms (absent: 0;
                   see _lease_clock.lua)

Returns 1 when a live lease was released, 0 when there was none (already expired or never
held).
]]
local leases, waiters, wexpiry, clock_key, released = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local channel = ARGV[2]
local lease_ms = tonumber(ARGV[4])

--#include _lease_clock.lua  (the lease clock)

local tomb = redis.call('ZSCORE', released, id)
if tomb then
  return math.floor(tonumber(tomb)) == tonumber(tomb) and 0 or 1
end

local now = lease_clock_now(clock_key, ARGV[3], ARGV[5])
-- Leases are compared on the shared clock: one already past its expiry is not "released".
local score = redis.call('ZSCORE', leases, id)
local live = score and tonumber(score) > now
local removed = redis.call('ZREM', leases, id)
local left = redis.call('ZREM', waiters, id)
redis.call('ZREM', wexpiry, id)
local answer = live and 1 or 0
redis.call('ZADD', released, math.ceil(now + lease_ms) + 0.5 * answer, id)
if redis.call('PTTL', released) < lease_ms + 1000 then
  redis.call('PEXPIRE', released, math.ceil(lease_ms) + 1000)
end
if (removed + left) > 0 and redis.call('ZCARD', waiters) > 0 then
  redis.call('PUBLISH', channel, id)
end
return answer
