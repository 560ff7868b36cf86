--[[ throttle_pause.lua: shared cooldown of a provider (after an upstream 429).

Sets pause = max(existing pause, clock + pause_ms). throttle_acquire.lua gives no slot before
the pause ends, to any caller on any instance. A shorter pause never shortens a longer one.

KEYS[1]  state     the provider's hash (fields tat, clock, pause, seq; see throttle_acquire.lua)
ARGV[1]  now_ms    caller's clock, ms since the epoch (float)
ARGV[2]  pause_ms  length of the cooldown from now, ms (>= 0)

Returns pause_until_ms (string): when the provider's cooldown ends, ms since the epoch.
]]
local state = KEYS[1]
local now = tonumber(ARGV[1])
local pause_ms = tonumber(ARGV[2])

local s = redis.call('HMGET', state, 'tat', 'clock', 'pause')
local tat = tonumber(s[1]) or 0
local clock = math.max(tonumber(s[2]) or 0, now)
local pause = math.max(tonumber(s[3]) or 0, clock + pause_ms)

local text = string.format('%.3f', math.ceil(pause * 1000) / 1000)
redis.call('HSET', state, 'pause', text, 'clock', string.format('%.3f', clock))
redis.call('PEXPIRE', state, math.ceil(math.max(tat, pause) - clock) + 1000)
return text
