--[[ _budget_thresholds.lua: usage-threshold crossings of a charge, for budget_reserve.lua.
Not a script of its own: LuaScript pastes it where a script says
`--#include _budget_thresholds.lua`.

A spec (Thresholds.script_arg: little-endian doubles, the margin in percentage points, then
the thresholds in percent of a window's limit, ascending) names them. Per window the user's meta keeps n, the highest threshold
already reported (percent; 0 = none; _budget_meta.lua). A charge that takes a window's total from `before` to `after` crosses threshold p when
before * 100 < p * limit <= after * 100 and p is above n: the charge itself took usage across
p. A plan change moves the limit, not the usage, so a user moved to a plan under which they
are already past p crosses nothing until usage falls below p and rises again; without the
`before` condition a level forgotten under a larger plan's limit would report p again on
the first charge back under the smaller one, though usage never fell. A reported threshold is forgotten (so that
it can be reported again) once a charge finds the total below it by more than the margin:
between two charges a total only falls (expiry, refund, settle), so the total a charge
starts from is the lowest since the previous charge, and nothing is missed by looking only
when charging. The level lives in meta and expires with it.
]]

-- The thresholds (ascending) and the margin of a spec; nil for an empty spec.
local function parse_thresholds(spec)
  if not spec or spec == '' then return nil end
  local n = #spec / 8
  local v = {struct.unpack('<' .. string.rep('d', n), spec)}
  local margin = table.remove(v, 1)
  v[n] = nil  -- struct's position
  return v, margin
end

-- One window's crossings: appends (position, percent) pairs to `out` for the thresholds a
-- charge taking the window's total from `before` to `after` crossed, and returns the
-- window's new level (`level` is the stored one; `limit` the window's).
local function cross(thresholds, margin, out, position, limit, before, after, level)
  -- forget the thresholds usage fell below by more than the margin since the last charge
  local kept = 0
  for _, p in ipairs(thresholds) do
    if p <= level and before * 100 >= (p - margin) * limit then kept = p end
  end
  local new_level = kept
  for _, p in ipairs(thresholds) do
    if p > kept and after * 100 >= p * limit and before * 100 < p * limit then
      out[#out + 1] = position
      out[#out + 1] = p
      new_level = p
    end
  end
  return new_level
end
