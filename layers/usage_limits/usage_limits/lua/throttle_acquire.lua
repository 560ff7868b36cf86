--[[ throttle_acquire.lua: reserve the earliest free slot of a provider's rate (GCRA).

One call per admission. The bucket is a single theoretical arrival time (TAT): every
admitted request moves it cost*T further, and a request may start once it is no more than
burst*T ahead of the clock. The slot is computed, and reserved only if the caller is willing
to wait for it; a rejected request writes nothing, so it never pushes anyone back. Each
admitted slot lies after every earlier reservation: FIFO by arrival, across all callers.

KEYS[1]  state        hash of the provider (all keys share the provider's hash tag):
                        tat    theoretical arrival time, ms since the epoch
                        clock  latest caller time seen, ms (the key's clock never runs back)
                        pause  shared cooldown end, ms (see throttle_pause.lua)
                        seq    number of reservations made (reservation order)
ARGV[1]  now_ms       caller's clock, ms since the epoch (float)
ARGV[2]  interval_ms  emission interval T: ms per unit of cost (per_s * 1000 / rate)
ARGV[3]  burst        bucket capacity, cost units (>= cost)
ARGV[4]  cost         this request's cost, cost units (> 0)
ARGV[5]  max_wait_ms  longest wait the caller accepts, ms (>= 0)

Returns {admitted, wait_ms, slot_ms, seq}:
  admitted  1 when the slot was reserved, 0 when it lies past max_wait_ms
  wait_ms   (string) slot minus the caller's now: how long to sleep, or Retry-After if 0
  slot_ms   (string) the slot, ms since the epoch
  seq       reservation number (strictly increasing per provider), 0 when not admitted
]]
local state = KEYS[1]
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local max_wait = tonumber(ARGV[5])

-- Fixed-point text keeps sub-ms precision (Lua's default %.14g would round ms timestamps);
-- stored times are rounded up so rounding can never admit more than the rate.
local function fmt(x) return string.format('%.3f', x) end
local function fmt_up(x) return string.format('%.3f', math.ceil(x * 1000) / 1000) end

local s = redis.call('HMGET', state, 'tat', 'clock', 'pause')
local tat = tonumber(s[1]) or 0
local clock = math.max(tonumber(s[2]) or 0, now)
local pause = tonumber(s[3]) or 0

local base = math.max(tat, clock, pause)
local new_tat = base + cost * interval
local slot = math.max(clock, pause, new_tat - burst * interval)
-- Relative to the caller's own now (not the clamped clock): a caller whose timestamp is a
-- little older than the key's clock sleeps a little longer and still wakes at the slot.
local wait = slot - now
if wait > max_wait then
  return {0, fmt(wait), fmt(slot), 0}
end

local seq = redis.call('HINCRBY', state, 'seq', 1)
redis.call('HSET', state, 'tat', fmt_up(new_tat), 'clock', fmt(clock))
-- Once the clock passes tat and pause the state is equivalent to a fresh key: let it go.
redis.call('PEXPIRE', state, math.ceil(math.max(new_tat, pause) - clock) + 1000)
return {1, fmt(wait), fmt(slot), seq}
