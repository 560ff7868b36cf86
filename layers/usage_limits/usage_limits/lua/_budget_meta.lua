--[[ _budget_meta.lua: a user's meta record, read and written as one field, for the budget
scripts. Not a script of its own: LuaScript pastes it where a script says
`--#include _budget_meta.lua` (after meta_key exists).
]]
local NONE = math.huge -- first event of a window that counts none (f = -1)

-- meta keeps everything in one field, m = "<clk> <dead>" then per window, shortest first,
-- ";<W> <t> <lo> <f> <d> <n>" (all integers): one HGET and one HSET per call, parsed and
-- written as one string. clk is the key's clock (ms); dead counts the events that have left
-- every window but are still stored (deleted in batches of PURGE, below); per window W (ms):
--   t   tokens the window counts
--   lo  cursor, ms: every event scored <= lo is out of t
--   f   score of the oldest event t counts, ms; -1 none (trusted only with t = 0); -2
--       unknown (looked up when needed): a cursor that stays below it passes no event, so
--       most calls read no range of the log
--   d   tokens drawn from grants by the events t counts (entitlements on; else 0)
--   n   the highest usage threshold already reported, percent (0 = none; _budget_thresholds)
-- A meta without m (a new user, or a meta written by an older layout) knows no window: each
-- is counted from the log once, as for a plan's new window, and the old fields are dropped.
local PURGE = 64
local FIELD = 'm'

-- meta as {clk = ms, dead = n, ws = {W, ...} (ascending), windows = {[W] = {total = tokens,
-- lo = ms, first = ms or NONE or nil (unknown), drawn = tokens, level = percent}}}.
local function load_meta()
  local packed = redis.call('HGET', meta_key, FIELD)
  local m = {clk = 0, dead = 0, windows = {}, ws = {}}
  if not packed then
    m.fresh = true
    return m
  end
  local clk, dead = string.match(packed, '^(%d+) (%d+)')
  m.clk, m.dead = tonumber(clk), tonumber(dead)
  local ws = m.ws
  for w, t, lo, f, d, n in string.gmatch(packed, ';(%d+) (%-?%d+) (%-?%d+) (%-?%d+) (%d+) (%d+)') do
    w, t, f = tonumber(w), tonumber(t), tonumber(f)
    if f == -2 or (f == -1 and t ~= 0) then f = nil elseif f == -1 then f = NONE end
    ws[#ws + 1] = w
    m.windows[w] = {total = t, lo = tonumber(lo), first = f, drawn = tonumber(d),
                    level = tonumber(n)}
  end
  return m
end

-- m as load_meta reads it.
local function encode_meta(m)
  local parts = {string.format('%d %d', m.clk, m.dead)}
  for i, w in ipairs(m.ws) do
    local s = m.windows[w]
    local f = s.first
    if f == nil then f = -2 elseif f == NONE then f = -1 end
    parts[i + 1] = string.format(';%d %d %d %d %d %d', w, s.total, s.lo, f, s.drawn, s.level)
  end
  return table.concat(parts)
end
