--[[ budget_refund.lua: lower or remove one request's charge (refund and settle).

Only the very charge of the caller is touched: the nonce recorded with the charge must equal
ARGV[3], the nonce of the reservation that made it. A refund kept for later, or re-sent by the
client after a lost reply, so finds nothing to lower once another call has charged the same
id again (with its own nonce).

A charge is still counted by a window while its score is above that window's cursor; only
those windows get tokens back. A window the event has already left gives nothing back (it
stopped counting the event then). The charge can only go down: a new cost at or above the
recorded one changes nothing. New cost 0 removes the event from the log (a full refund).
Only the given user's keys are touched, so another user's request id is never found.

KEYS[1]  log         zset: member = request id, score = time of the charge, ms since the epoch
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>" (cost in tokens)
KEYS[3]  meta        hash: m, the clock and each window's total, cursor, first event and
                     drawn tokens (_budget_meta.lua)
ARGV[1]  request_id  the charge's id
ARGV[2]  new_cost    tokens the request really used (integer >= 0; 0 = refund it all)
ARGV[3]  nonce       the nonce of the reservation that made the charge (no spaces)

With entitlements on (KEYS[4] and KEYS[5] given; see _budget_grants.lua):
KEYS[4]  ent         hash: epoch, g:<reference> (the user's live grants), ...
KEYS[5]  dr          hash: request id -> "#<epoch> <ref>=<n> ..." (draws of each charge)
ARGV[4]  now_ms      caller's clock, ms since the epoch (clamped to meta's clk): a grant
                     expired at it (now >= expiry) gets nothing back
ARGV[5]  low         credit "low" threshold, percent of a grant's tokens
ARGV[6]  low_margin  percentage points above `low` that re-arm a grant's credit reports
ARGV[7]  credit      "<ref>=<n> ..." the credit this lowering gives back, as the record of
                     truth decided it ('' = none; '*' = the drawn part taken off the charge,
                     for a draw that was never recorded there): one recorded gets what
                     DynamoDB returned
ARGV[8]  uncross     "<W>=<level> ..." usage-threshold levels to restore (a charge undone
                     at once, whose crossings were never reported): each window of W ms
                     keeps at most that level ('' = none)
Lowering a charge by delta lowers its drawn part first: back = min(delta, drawn), taken
from its draws in reverse draw order; the dr record keeps the draws not given back, and
windows still counting the event get t -= delta, d -= back. The credit of ARGV[7] goes back
to the copy's grants only when the draw was made under ent's current epoch (the copy is the
one the draw came from) and each grant is still there and not expired; otherwise the copy
gets none of it and `stale` is 1: the caller drops the copy, which reloads what DynamoDB
holds.

Returns 1 when the charge was lowered or removed, 0 when there was none to lower (unknown,
expired or already refunded id, another call's charge, or new_cost >= the recorded cost).
Run twice, the second run finds the charge gone or already at new_cost and returns 0.
Entitlements on: {changed (1/0), ent epoch (0 = not loaded), {returned: ref, n, ...},
stale (1/0)}; a second run returns nothing and stale 0.
Keys keep the expiry set by the last reservation: this script only removes or lowers data.
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]
local ent_key = KEYS[4]
local dr_key = KEYS[5]

local request_id = ARGV[1]
local new_cost = tonumber(ARGV[2])
local nonce = ARGV[3]
local now_arg = tonumber(ARGV[4] or '0')
local low = tonumber(ARGV[5] or '0')
local low_margin = tonumber(ARGV[6] or '0')
local credit_arg = ARGV[7] or ''
local uncross_arg = ARGV[8] or ''

--#include _budget_meta.lua  (meta's one-field layout)
local entitled = dr_key ~= nil
--#include _budget_grants.lua  (entitlements and draws)

local function done(changed, epoch, returned, stale)
  if not dr_key then return changed end
  return {changed, epoch or 0, returned or {}, stale or 0}
end

local score = redis.call('ZSCORE', log_key, request_id)
if not score then return done(0) end
score = tonumber(score)

local rec = redis.call('HGET', ev_key, request_id)
-- another call's charge of the same id (or no record at all): not this caller's to lower
if not rec or string.match(rec, '^%d+ (%S+)') ~= nonce then return done(0) end
local old_cost = tonumber(string.match(rec, '^%d+')) or 0
local rest = string.match(rec, '^%d+(.*)$') or ''
if new_cost >= old_cost and new_cost > 0 then return done(0) end

local m = load_meta()
local longest = m.ws[#m.ws]
-- the event has left every window (the longest one's cursor passed it; it is only waiting to
-- be deleted): it is no charge any more, and nothing is given back
if longest and score <= m.windows[longest].lo then return done(0) end

local delta = old_cost - new_cost

-- the drawn part first: back = min(delta, drawn), in reverse draw order
local back, returned, epoch, stale = 0, {}, 0, 0
if dr_key then
  local draw_epoch, list = G.more().parse_draws(redis.call('HGET', dr_key, request_id))
  local credit = {}
  for ref, n in string.gmatch(credit_arg, '(%S+)=(%d+)') do credit[#credit + 1] = {ref, tonumber(n)} end
  if #list > 0 or #credit > 0 or credit_arg == '*' then
    local ent = G.load_ent(ent_key)
    epoch = ent.epoch or 0
    local left, taken = delta, {}
    for k = #list, 1, -1 do
      if left == 0 then break end
      local d = list[k]
      local n = math.min(left, d[2])
      left, back = left - n, back + n
      d[2] = d[2] - n
      if n > 0 then taken[#taken + 1] = {d[1], n} end
    end
    if credit_arg == '*' then credit = taken end
    if #credit > 0 then
      if draw_epoch == nil or draw_epoch ~= ent.epoch then
        stale = 1  -- not the copy the draw came from: it gets nothing, and is dropped
      else
        local now = math.max(now_arg, m.clk)
        local grants, fields = {}, {}
        for _, g in ipairs(G.more().grants_of(ent)) do grants[g.ref] = g end
        for _, c in ipairs(credit) do
          local g = grants[c[1]]
          if g and G.more().is_live(g, now) then
            g.remaining = math.min(g.tokens, g.remaining + c[2])
            if g.remaining * 100 > (low + low_margin) * g.tokens then g.flags = '' end
            returned[#returned + 1] = c[1]
            returned[#returned + 1] = c[2]
            fields[#fields + 1] = 'g:' .. g.ref
            fields[#fields + 1] = G.more().grant_value(g)
          else
            stale = 1
          end
        end
        if #fields > 0 then redis.call('HSET', ent_key, unpack(fields)) end
      end
    end
    if #list > 0 then
      local kept = {}
      for _, d in ipairs(list) do
        if d[2] > 0 then kept[#kept + 1] = d end
      end
      if #kept == 0 or new_cost == 0 then
        redis.call('HDEL', dr_key, request_id)
      else
        redis.call('HSET', dr_key, request_id, G.more().encode_draws(draw_epoch, kept))
      end
    end
  end
end

-- usage-threshold levels set by this very charge, restored when it is undone at once
local restore = {}
for w, level in string.gmatch(uncross_arg, '(%d+)=(%d+)') do restore[tonumber(w)] = tonumber(level) end

for _, w in ipairs(m.ws) do
  local s = m.windows[w]
  -- still counted by this window: give the difference back (and the drawn part to d)
  if score > s.lo then
    s.total = s.total - delta
    s.drawn = s.drawn - back
  end
  -- the window's oldest event leaves the log: the next call looks its successor up
  if new_cost == 0 and s.first == score then s.first = nil end
  if restore[w] and s.level > restore[w] then s.level = restore[w] end
end
if not m.fresh then redis.call('HSET', meta_key, FIELD, encode_meta(m)) end

if new_cost == 0 then
  redis.call('ZREM', log_key, request_id)
  redis.call('HDEL', ev_key, request_id)
else
  redis.call('HSET', ev_key, request_id, string.format('%d', new_cost) .. rest)
end
return done(1, epoch, returned, stale)
