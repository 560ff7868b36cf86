--[[ _budget_meta.lua: a user's meta record, read and written as one field, for the budget
scripts. Not a script of its own: LuaScript pastes it where a script says
`--#include _budget_meta.lua` (after the key names exist).
]]
local NONE = math.huge -- first event of a window that counts none (f = -1)

-- meta keeps everything in one field m, binary: little-endian doubles (struct.pack '<d',
-- exact for integers up to 2^53), clk and dead, then per window, shortest first, W t lo f d n.
-- One HGET and one HSET a call, decoded and encoded by one struct call each: no pattern,
-- no number parsed from text, no string formatted. clk is the key's clock (ms); dead counts
-- the events that have left every window but are still stored (deleted in batches of
-- PURGE); per window W (ms):
--   t   tokens the window counts
--   lo  cursor, ms: every event scored <= lo is out of t
--   f   score of the oldest event t counts, ms; -1 none (trusted only with t = 0); -2
--       unknown (looked up when needed): a cursor that stays below it passes no event, so
--       most calls read no range of the log
--   d   tokens drawn from grants by the events t counts (entitlements on; else 0)
--   n   the highest usage threshold already reported, percent (0 = none; _budget_thresholds)
-- A meta without m (a new user, or a meta written by an older layout) knows no window: each
-- is counted from the log once, as for a plan's new window, and the old fields are dropped.
local PURGE = 8
local FIELD = 'm'

-- meta as {clk = ms, dead = n, ws = {W, ...} (ascending), windows = {[W] = {total = tokens,
-- lo = ms, first = ms or NONE or nil (unknown), drawn = tokens, level = percent}}}.
-- `packed` is the field when the caller has read it already (false: there is none); nil
-- reads it here.
local function load_meta(packed)
  if packed == nil then packed = redis.call('HGET', meta_key, FIELD) end
  if not packed then
    return {clk = 0, dead = 0, windows = {}, ws = {}, fresh = true}
  end
  local n = #packed / 8
  local v = {struct.unpack('<' .. string.rep('d', n), packed)}  -- then the position, unused
  local m = {clk = v[1], dead = v[2], windows = {}, ws = {}}
  local ws = m.ws
  for i = 3, n - 5, 6 do
    local w, t, f = v[i], v[i + 1], v[i + 3]
    if f == -2 or (f == -1 and t ~= 0) then f = nil elseif f == -1 then f = NONE end
    ws[#ws + 1] = w
    m.windows[w] = {total = t, lo = v[i + 2], first = f, drawn = v[i + 4], level = v[i + 5]}
  end
  return m
end

-- m as load_meta reads it.
local function encode_meta(m)
  local v, ws = {m.clk, m.dead}, m.ws
  for i = 1, #ws do
    local s = m.windows[ws[i]]
    local f = s.first
    if f == nil then f = -2 elseif f == NONE then f = -1 end
    local k = 6 * i - 3
    v[k], v[k + 1], v[k + 2], v[k + 3], v[k + 4], v[k + 5] = ws[i], s.total, s.lo, f, s.drawn,
                                                             s.level
  end
  return struct.pack('<' .. string.rep('d', #v), unpack(v))
end

-- Delete the events scored <= lo (they have left every window) with their records, 500 ids
-- a call.
local function purge(lo)
  repeat
    local ids = redis.call('ZRANGEBYSCORE', log_key, '-inf', string.format('%d', lo), 'LIMIT',
                           '0', 500)
    if #ids == 0 then break end
    redis.call('HDEL', ev_key, unpack(ids))
    if dr_key then redis.call('HDEL', dr_key, unpack(ids)) end
    redis.call('ZREM', log_key, unpack(ids))
  until #ids < 500
end

-- Every key of the user lives `ttl` ms from now; ent only gains (a load's expiry may be
-- longer). Called when a reservation finds the expiry due.
local function renew_expiry(ttl)
  ttl = string.format('%d', ttl)
  redis.call('PEXPIRE', log_key, ttl)
  redis.call('PEXPIRE', ev_key, ttl)
  redis.call('PEXPIRE', meta_key, ttl)
  if dr_key then
    redis.call('PEXPIRE', ent_key, ttl, 'GT')  -- never shortens a load's expiry
    redis.call('PEXPIRE', dr_key, ttl)
  end
end
