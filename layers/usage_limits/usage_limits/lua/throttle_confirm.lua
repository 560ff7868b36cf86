--[[ throttle_confirm.lua: a queued request asks again, just before the slot it was told.

The request's queue entry (throttle_acquire.lua answered "queued") books the earliest slot
when it is the head of the fair queue (no entry with a lower start tag, or an equal tag and
an earlier arrival, except entries whose told slot lies more than reach_ms before the clock:
their callers are late, and book the next slot when they come) and that slot lies within
horizon_ms of the caller's clock. Otherwise it
stays queued and is told its slot again: later than before when fairer requests arrived
meanwhile ("moved: sleep more"), the same when the head has not booked yet. A request whose
slot now lies past max_wait_ms leaves the queue and is refused. An entry that is gone (it
expired: its caller came back later than its told slot plus grace_ms) is answered "gone":
the caller asks anew as a new arrival.

Idempotent per call: the answer is kept under the call's own key, and the same call run
again gets it and changes nothing.

KEYS[1..6]  state, answer, queue, entries, expiry, users: as throttle_acquire.lua
ARGV[1]  now_ms        caller's clock, ms since the epoch (float)
ARGV[2]  interval_ms   emission interval T: ms per unit of cost
ARGV[3]  burst         bucket capacity, cost units
ARGV[4]  max_wait_ms   longest wait the caller still accepts, ms (>= 0)
ARGV[5]  answer_ttl_ms how long this call's answer is kept for a re-sent call, ms
ARGV[6]  horizon_ms    how far ahead of the caller's clock a slot may be booked, ms (>= 0)
ARGV[7]  entry         the request's queue entry (from throttle_acquire.lua)
ARGV[8]  grace_ms      how late after its told slot the caller may ask again, ms
ARGV[9]  reach_ms      how far before the caller's clock its slot may lie, ms (>= 0): the
                       caller's dispatch jitter allowance. A head that asks late still gets
                       the slot it was told (up to reach_ms back; the caller goes at once,
                       within its allowance), so the slots after it do not move

Returns {status, wait_ms, slot_ms, seq, entry} as throttle_acquire.lua, and status 4 (gone:
ask anew) with wait_ms 0.
]]
--#include _fair_queue.lua  (the fair queue)
--#include _throttle_call.lua  (a call's kept answer, opening and closing)

local state, answer = KEYS[1], KEYS[2]
local queue, entries, expiry, users = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local max_wait = tonumber(ARGV[4])
local answer_ttl = tonumber(ARGV[5])
local horizon = tonumber(ARGV[6])
local entry = ARGV[7]
local grace = tonumber(ARGV[8])
local reach = tonumber(ARGV[9])

local replayed = tc_replay(answer, now)
if replayed then return replayed end

local tat, clock, pause, vt = tc_open(state, queue, entries, expiry, now)
local keys = {state, queue, entries, expiry, users}

local reply
local info = redis.call('HGET', entries, entry)
if not info then
  reply = {4, fmt(0), fmt(now), 0, ''}
else
  local cost, deadline, _, user = string.match(info, '^(%S+) (%S+) (%S+) (.*)$')
  cost, deadline = tonumber(cost), tonumber(deadline)
  local start = tonumber(redis.call('ZSCORE', queue, entry))
  local ahead = fq_ahead(queue, entries, start, entry, clock - reach)
  -- Slots count from the clock less the reach: the GCRA bound holds for any such clock.
  local from = clock - reach
  local slot = fq_slot(tat, from, pause, interval, burst, ahead + cost)
  local wait = slot - now
  if wait > max_wait then
    fq_remove(queue, entries, expiry, entry)
    reply = {0, fmt(wait), fmt(slot), 0, ''}
  elseif ahead == 0 and wait <= horizon then
    local seq = redis.call('HINCRBY', state, 'seq', 1)
    tat = math.max(tat, from, pause) + cost * interval
    redis.call('HSET', state, 'tat', fmt_up(tat), 'vt', tag_text(math.max(vt, start)))
    fq_remove(queue, entries, expiry, entry)
    reply = {1, fmt(wait), fmt(slot), seq, ''}
  else
    fq_tell(entries, expiry, entry, cost, deadline, slot, user, grace)
    reply = {3, fmt(wait), fmt(slot), 0, entry}
  end
end
return tc_close(answer, answer_ttl, reply, keys, clock, tat, pause, expiry)
