--[[ throttle_acquire.lua: a request asks for a slot of a provider's rate (GCRA), fairly.

One call per admission while the provider is not saturated: when nobody is queued and the
earliest slot (GCRA) lies within horizon_ms of the caller's clock, it is booked at once.
Otherwise the request joins the provider's fair queue (see _fair_queue.lua) under its start
tag and is told the slot it would get if everyone ahead of it booked first; it asks again
just before that slot (throttle_confirm.lua). A request whose slot lies past max_wait_ms is
refused and queues nothing, so it never pushes anyone back.

Idempotent per call: the answer is kept under the call's own key for answer_ttl_ms, and the
same call run again (redis-py re-sends a script whose reply was lost; a command held up in
the network may arrive late) gets that answer and changes nothing.

KEYS[1]  state        hash of the provider (all keys share the provider's hash tag):
                        tat    theoretical arrival time, ms since the epoch
                        clock  latest caller time seen, ms (the key's clock never runs back)
                        pause  shared cooldown end, ms (see throttle_pause.lua)
                        seq    number of slots booked (booking order)
                        vt     virtual time V: the start tag of the last request booked
                        qseq   number of requests queued (arrival order of queue entries)
KEYS[2]  answer       string: this call's answer "<status> <slot_ms> <seq> <entry or ->"
KEYS[3]  queue        } the fair queue, see _fair_queue.lua
KEYS[4]  entries      }
KEYS[5]  expiry       }
KEYS[6]  users        }
ARGV[1]  now_ms        caller's clock, ms since the epoch (float)
ARGV[2]  interval_ms   emission interval T: ms per unit of cost
ARGV[3]  burst         bucket capacity, cost units (>= cost)
ARGV[4]  cost          this request's cost, cost units (> 0)
ARGV[5]  max_wait_ms   longest wait the caller accepts, ms (>= 0)
ARGV[6]  answer_ttl_ms how long this call's answer is kept for a re-sent call, ms
ARGV[7]  horizon_ms    how far ahead of the caller's clock a slot may be booked, ms (>= 0)
ARGV[8]  user          whose request this is (the unit of fairness)
ARGV[9]  weight        the user's share weight (> 0; 1 for everyone gives equal shares)
ARGV[10] grace_ms      how late after its told slot a queued caller may ask again, ms
ARGV[11] request_id    unique per request: names its queue entry

Returns {status, wait_ms, slot_ms, seq, entry}:
  status   1 booked: sleep until slot_ms, then call; 3 queued: ask again (confirm with
           entry) just before slot_ms; 0 refused: slot_ms lies past max_wait_ms
  wait_ms  (string) slot minus the caller's now: the sleep, or Retry-After when refused
  slot_ms  (string) the slot booked, or told (a lower bound while queued), ms
  seq      booking number (strictly increasing per provider), 0 when nothing was booked
  entry    the queue entry when queued, else ''
]]
--#include _fair_queue.lua  (the fair queue)
--#include _throttle_call.lua  (a call's kept answer, opening and closing)

local state, answer = KEYS[1], KEYS[2]
local queue, entries, expiry, users = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local max_wait = tonumber(ARGV[5])
local answer_ttl = tonumber(ARGV[6])
local horizon = tonumber(ARGV[7])
local user = ARGV[8]
local weight = tonumber(ARGV[9])
local grace = tonumber(ARGV[10])

local replayed = tc_replay(answer, now)
if replayed then return replayed end

local tat, clock, pause, vt = tc_open(state, queue, entries, expiry, now)
-- A finish tag at or below V is no backlog: the same as no entry (keeps the set small).
redis.call('ZREMRANGEBYSCORE', users, '-inf', tag_text(vt))
local start = math.max(vt, tonumber(redis.call('ZSCORE', users, user)) or vt)
local ahead = 0
local queued = redis.call('ZCARD', queue) > 0
if queued then ahead = fq_ahead(queue, entries, start, nil, -math.huge) end
local slot = fq_slot(tat, clock, pause, interval, burst, ahead + cost)
-- Relative to the caller's own now (not the clamped clock): a caller whose timestamp is a
-- little older than the key's clock sleeps a little longer and still wakes at the slot.
local wait = slot - now
local keys = {state, queue, entries, expiry, users}

local reply
if wait > max_wait then
  reply = {0, fmt(wait), fmt(slot), 0, ''}
elseif not queued and wait <= horizon then
  local seq = redis.call('HINCRBY', state, 'seq', 1)
  tat = math.max(tat, clock, pause) + cost * interval
  redis.call('HSET', state, 'tat', fmt_up(tat), 'vt', tag_text(start))
  redis.call('ZADD', users, tag_text(start + cost / weight), user)
  reply = {1, fmt(wait), fmt(slot), seq, ''}
else
  local qseq = redis.call('HINCRBY', state, 'qseq', 1)
  local entry = string.format('%015d', qseq) .. ':' .. ARGV[11]
  local deadline = now + max_wait
  redis.call('ZADD', queue, tag_text(start), entry)
  fq_tell(entries, expiry, entry, cost, deadline, slot, user, grace)
  redis.call('ZADD', users, tag_text(start + cost / weight), user)
  reply = {3, fmt(wait), fmt(slot), 0, entry}
end
return tc_close(answer, answer_ttl, reply, keys, clock, tat, pause, expiry)
