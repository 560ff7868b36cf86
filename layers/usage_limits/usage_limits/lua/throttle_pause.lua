--[[ throttle_pause.lua: shared cooldown of a provider (after an upstream 429).

Sets pause = max(existing pause, clock + pause_ms). throttle_acquire.lua and
throttle_confirm.lua book no slot before the pause ends, for any caller on any instance.
A shorter pause never shortens a longer one.

Idempotent per call: the answer is kept under the call's own key, so the same call run again
(a re-sent script, or one held up in the network) returns it and does not extend the pause
from a clock that moved on meanwhile.

KEYS[1]  state          the provider's hash (fields tat, clock, pause, seq; see
                        throttle_acquire.lua)
KEYS[2]  answer         string: this call's answer (pause_until_ms) once it ran
KEYS[3]  expiry         the fair queue's expiries (see _fair_queue.lua): the state lives as
                        long as its last queue entry
ARGV[1]  now_ms         caller's clock, ms since the epoch (float)
ARGV[2]  pause_ms       length of the cooldown from now, ms (>= 0; the caller bounds it)
ARGV[3]  answer_ttl_ms  how long the answer is kept for a re-sent call, ms

Returns pause_until_ms (string): when the provider's cooldown ends, ms since the epoch.
]]
local state, answer = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local pause_ms = tonumber(ARGV[2])
local answer_ttl = tonumber(ARGV[3])

local done = redis.call('GET', answer)
if done then return done end

local s = redis.call('HMGET', state, 'tat', 'clock', 'pause')
local tat = tonumber(s[1]) or 0
local clock = math.max(tonumber(s[2]) or 0, now)
local pause = math.max(tonumber(s[3]) or 0, clock + pause_ms)

local text = string.format('%.3f', math.ceil(pause * 1000) / 1000)
redis.call('HSET', state, 'pause', text, 'clock', string.format('%.3f', clock))
local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', state, math.ceil(math.max(tat, pause, tonumber(last[2]) or 0) - clock) + 1000)
redis.call('SET', answer, text, 'PX', math.ceil(answer_ttl))
return text
