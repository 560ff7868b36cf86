--[[ _throttle_call.lua: what every call of throttle_acquire.lua and throttle_confirm.lua does
around its own decision. Not a script of its own: LuaScript pastes it where a script says
`--#include _throttle_call.lua` (after _fair_queue.lua, whose helpers it uses).

A call opens by replaying the answer it already gave, if any (tc_replay: redis-py re-sends a
script whose reply was lost, and a command held up in the network may arrive late), else by
reading the provider's state (tc_open: the key's clock moves forward to the caller's, never
back, and expired queue entries leave). It closes by keeping its answer under its own key for
a re-sent call and setting every key's expiry (tc_close).

The answer is kept as the text "<status> <slot_ms> <seq> <entry or ->"; a replay answers
the same status, slot, seq and entry, with the wait counted from the re-sent call's own now.
]]

-- The answer this call gave before, {status, wait_ms, slot_ms, seq, entry}, or nil.
local function tc_replay(answer, now)
  local done = redis.call('GET', answer)
  if not done then return nil end
  local status, slot, seq, entry = string.match(done, '^(%S+) (%S+) (%S+) (%S+)$')
  if entry == '-' then entry = '' end
  return {tonumber(status), fmt(tonumber(slot) - now), slot, tonumber(seq), entry}
end

-- Read the provider's state (tat, clock, pause, vt), move its clock to the caller's now
-- (never back), and drop the queue entries that expired by then.
local function tc_open(state, queue, entries, expiry, now)
  local s = redis.call('HMGET', state, 'tat', 'clock', 'pause', 'vt')
  local tat = tonumber(s[1]) or 0
  local clock = math.max(tonumber(s[2]) or 0, now)
  local pause = tonumber(s[3]) or 0
  local vt = tonumber(s[4]) or 0
  -- The first write may need memory (HSET): under maxmemory it is refused before any
  -- other write, so an out-of-memory server changes nothing (Redis lets a script that
  -- has written once go on writing).
  redis.call('HSET', state, 'clock', fmt(clock))
  fq_purge(queue, entries, expiry, clock)
  return tat, clock, pause, vt
end

-- Set the expiry of every key of the provider (`keys`, see fq_expire), keep `reply` under
-- `answer` for answer_ttl_ms, and return it.
local function tc_close(answer, answer_ttl, reply, keys, clock, tat, pause, expiry)
  fq_expire(keys, clock, tat, pause, expiry)
  local entry_text = reply[5] ~= '' and reply[5] or '-'
  redis.call('SET', answer, reply[1] .. ' ' .. reply[3] .. ' ' .. reply[4] .. ' ' .. entry_text,
             'PX', math.ceil(answer_ttl))
  return reply
end
