--[[ throttle_lease_release.lua: give back a lease, or leave the queue, and wake the waiters.

Removes the id from the leases and from the queue (a caller that gives up waiting calls this
too). When that can let a queued caller in, publishes on the wake-up channel; waiters treat
the message as a hint only and re-check with throttle_lease_acquire.lua.

KEYS[1]  leases    zset: lease id -> lease expiry, ms since the epoch
KEYS[2]  waiters   zset: lease id -> ticket
KEYS[3]  wexpiry   zset: lease id -> queue entry expiry, ms
ARGV[1]  id        the lease id
ARGV[2]  channel   pub/sub channel of the provider's wake-ups

Returns 1 when a lease was released, 0 when there was none (already expired or never held).
]]
local leases, waiters, wexpiry = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local channel = ARGV[2]

local released = redis.call('ZREM', leases, id)
local left = redis.call('ZREM', waiters, id)
redis.call('ZREM', wexpiry, id)
if (released + left) > 0 and redis.call('ZCARD', waiters) > 0 then
  redis.call('PUBLISH', channel, id)
end
return released
