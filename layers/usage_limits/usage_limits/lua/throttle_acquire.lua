--[[ throttle_acquire.lua: reserve the earliest free slot of a provider's rate (GCRA).

One call per admission. The bucket is a single theoretical arrival time (TAT): every
admitted request moves it cost*T further, and a request may start once it is no more than
burst*T ahead of the clock. The slot is computed, and reserved only if the caller is willing
to wait for it; a rejected request writes nothing, so it never pushes anyone back. Each
admitted slot lies after every earlier reservation: FIFO by arrival, across all callers.

Idempotent per call: a reservation's answer is kept under the call's own key for
answer_ttl_ms, and the same call run again (redis-py re-sends a script whose reply was lost;
a command held up in the network may arrive late) gets that answer and reserves nothing.

Recheck (ARGV[7] = 1): the caller holds a slot and slept until just before it. If the
provider is paused at the moment it would call (ARGV[8]; an upstream 429 landed meanwhile),
the old slot is given up and a new one after the pause is reserved, as by a fresh call; if
not, nothing is written and the caller goes at its slot.

KEYS[1]  state        hash of the provider (all keys share the provider's hash tag):
                        tat    theoretical arrival time, ms since the epoch
                        clock  latest caller time seen, ms (the key's clock never runs back)
                        pause  shared cooldown end, ms (see throttle_pause.lua)
                        seq    number of reservations made (reservation order)
KEYS[2]  answer       string: this call's answer "<slot_ms> <seq>" once it reserved a slot
ARGV[1]  now_ms        caller's clock, ms since the epoch (float)
ARGV[2]  interval_ms   emission interval T: ms per unit of cost (per_s * 1000 / rate)
ARGV[3]  burst         bucket capacity, cost units (>= cost)
ARGV[4]  cost          this request's cost, cost units (> 0)
ARGV[5]  max_wait_ms   longest wait the caller accepts, ms (>= 0)
ARGV[6]  answer_ttl_ms how long a reservation's answer is kept for a re-sent call, ms
ARGV[7]  recheck       1: the caller slept to a slot it holds; 0: an ordinary reservation
ARGV[8]  call_at_ms    recheck only: the slot the caller holds (its answer's slot_ms), ms

Returns {admitted, wait_ms, slot_ms, seq}:
  admitted  1 when a slot was reserved (now or by the same call before), 0 when it lies
            past max_wait_ms, 2 (recheck only) when the provider is not paused: go
  wait_ms   (string) slot minus the caller's now: how long to sleep, or Retry-After if 0
  slot_ms   (string) the slot, ms since the epoch (the caller's now when admitted is 2)
  seq       reservation number (strictly increasing per provider), 0 when none was made
]]
local state, answer = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local max_wait = tonumber(ARGV[5])
local answer_ttl = tonumber(ARGV[6])
local recheck = ARGV[7] == '1'
local call_at = tonumber(ARGV[8])

-- Fixed-point text keeps sub-ms precision (Lua's default %.14g would round ms timestamps);
-- stored times are rounded up so rounding can never admit more than the rate.
local function fmt(x) return string.format('%.3f', x) end
local function fmt_up(x) return string.format('%.3f', math.ceil(x * 1000) / 1000) end

local done = redis.call('GET', answer)
if done then
  local slot, seq = string.match(done, '^(%S+) (%S+)$')
  return {1, fmt(tonumber(slot) - now), slot, tonumber(seq)}
end

local s = redis.call('HMGET', state, 'tat', 'clock', 'pause')
local tat = tonumber(s[1]) or 0
local clock = math.max(tonumber(s[2]) or 0, now)
local pause = tonumber(s[3]) or 0

if recheck and pause <= call_at then
  return {2, '0', fmt(now), 0}
end

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
redis.call('SET', answer, fmt(slot) .. ' ' .. seq, 'PX', math.ceil(answer_ttl))
return {1, fmt(wait), fmt(slot), seq}
