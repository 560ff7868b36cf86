--[[ budget_reserve.lua: charge one request to a user's token budget if it fits every window.

The ledger keeps a running total per window instead of summing the window: each call moves
every window's cursor up to its new boundary and subtracts only the events that crossed it,
so each event is subtracted once per window and a call costs O(log N + expired events).
A call where no event leaves any window reads no range of the log.

KEYS[1]  log         zset: member = request id, score = time of the charge, ms since the epoch
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>" (cost in tokens)
KEYS[3]  meta        hash: m, the key's clock (it never runs back) and per window a running
                     total, a cursor (every event scored <= it is out of the total) and the
                     oldest event counted, so that most calls read no range of the log
                     (_budget_meta.lua); with entitlements on also lp, "<ms> <plan name>"
                     of the last charge (what the operator's view shows)
ARGV[1]  numbers     now_ms, cost and margin_ms as three little-endian doubles (struct '<ddd'),
                     optionally a fourth, hold_ms:
                       now_ms     caller's clock, ms since the epoch (integer)
                       cost       tokens to charge (integer >= 1)
                       margin_ms  keys live this long past the longest window, ms (>= 0)
                       hold_ms    with the pv key: the charge is provisional until confirmed
                                  (budget_hold.lua); from now + hold_ms on, any request of the
                                  user may undo it (0 or absent: not provisional, and with
                                  the pv key, the id is taken out of pv)
ARGV[2]  request_id  the charge's id (printable, at most 256 characters)
ARGV[3]  record      "<cost> <nonce> <route>", stored as the charge's ev record as it is:
                       nonce  random per call, no spaces: tells a client's re-send of this
                              very call (same nonce) from a second reservation of the same
                              id (other nonce)
                       route  recorded with the charge (audit trail), may be empty
ARGV[4]  plan        the windows, shortest first, binary: per window its length in ms and its
                     limit in tokens, each a little-endian double (struct.pack '<dd...'):
                     one argument the client encodes once per plan, and one struct call
                     here instead of parsing two numbers per window from text
ARGV[5]  thresholds  optional: usage thresholds, the margin in percentage points then the
                     percents of a window's limit, ascending, as little-endian doubles
                     (_budget_thresholds.lua); absent or '' = none
KEYS[4] (entitlements off) or KEYS[6] (on), optional:
         pv          zset: request id -> when its provisional charge may be undone, ms on the
                     key's clock (-1: being undone); see budget_hold.lua
(Few arguments, each cheap to read: the client encodes, and Redis and Lua take in, one
string per argument on every call.)

With entitlements on (KEYS[4] and KEYS[5] given; _budget_grants.lua describes them):
KEYS[4]  ent         hash: epoch, want, plan, susp, g:<reference> (the user's entitlements)
KEYS[5]  dr          hash: request id -> "#<epoch> <ref>=<n> ..." (draws of each charge)
ARGV[6]  entitled    "<plan_name> <low> <low_margin> <catalog>" in one argument (the client
                     encodes it once per plan name):
                     plan_name   the caller's plan (JWT claim or default; may be empty),
                                 used unless ent.plan names a plan of the catalog
                     low         credit "low" threshold, percent of a grant's tokens (0..100)
                     low_margin  percentage points above `low` a grant must get back before
                                 its reports are re-armed (budget_refund.lua's; unused here)
                     catalog     the deployment's plans, ";<name>=<plan>;<name>=<plan>",
                                 each <plan> as "<window_ms>:<limit>" items separated
                                 by single spaces, shortest first; may be empty
The plan's longest window is the quota Q; meta keeps d:<W>, tokens drawn from grants by the
events window W counts, and the quota's used is t:<Q> - d:<Q>. A charge that fits every
shorter window (full cost) but needs need = used + cost - Q > 0 tokens over the quota draws
min(need, cost) from the live grants (draw order in _budget_grants.lua), or is rejected when
their credit is short. A cost above Q itself is served the same way (credit pays at least
cost - Q); while credit is short of cost - Q it is answered 5, as waiting cannot help, and
otherwise a rejection waits until the quota frees need - credit tokens. Each grant drawn reports crossing "low" (remaining from > low% of its
tokens to <= low%) and "exhausted" (remaining 0) once.

Run twice with the same arguments (redis-py re-sends a call whose reply was lost): the second
run finds the id charged with its own nonce and answers status 1 again, charging nothing
(and holding nothing more: the first run's pv entry stands).

Returns {status, retry_after_ms, binding, then per plan window: used, resets_at_ms}
  (entitlements on: {status, retry_after_ms, binding, ent, then per window of the plan used})
  status          1 charged (now, or by this very call before a client re-sent it);
                  2 duplicate: the id was charged by another call, nothing charged now;
                  0 rejected: some window lacks room, nothing charged;
                  entitlements on only: 3 suspended, 4 not loaded (ent has no epoch),
                  5 cost above a window's limit of the plan used (binding names it):
                    a shorter window's, or the quota's when the live credit (reported)
                    is short of the part beyond the quota, cost - Q;
                  nothing is charged, advanced or written for 3, 4 and 5; a re-send of
                  a call that charged is answered as that charge (1) instead
  retry_after_ms  0 unless rejected; else ms until enough of the oldest events have left
                  every failing window (the longest of their waits)
  binding         when rejected, the position (1-based) of the window with that wait; else 0
  used            tokens in the window after this call
  resets_at_ms    when the oldest counted event leaves the window, ms; -1 when it is empty
then, when this call charged and crossed thresholds, per crossing: window position, percent
  ent             one string (one reply element costs the client less than a nested one):
                  "<epoch> <drawn> <credit> <susp> <plan used>|<draws>|<credit crossings>"
                  epoch   0 = not loaded; for a re-send, the epoch its draws were made under
                  credit  live credit after the call (a charge, a re-send, a reject);
                          -1 = not read (a duplicate, or statuses 3 and 4)
                  susp    suspended until, ms (0 = until lifted); -1 = not suspended
                  draws   "<ref>=<n> <ref>=<n>" in draw order (may be empty)
                  credit crossings  "<kind> <remaining> <tokens> <grant kind> <ref>;..." kind
                                    low|exhausted, grant kind promo|paid
A re-send reports the draws its first run made (from dr) and draws nothing more.
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]
local ent_key = KEYS[4]
local dr_key = KEYS[5]

local now_arg, cost, margin_ms = struct.unpack('<ddd', ARGV[1])
local hold_ms = #ARGV[1] >= 32 and select(4, struct.unpack('<dddd', ARGV[1])) or 0
local pv_key = (#KEYS == 4 or #KEYS == 6) and KEYS[#KEYS] or nil
local request_id = ARGV[2]
local record = ARGV[3]
local plan = ARGV[4]
local call_windows, limits = {}, {}
local threshold_spec = ARGV[5] or ''
local entitled_arg = ARGV[6]
local plan_name = entitled_arg and string.match(entitled_arg, '^%S*')  -- the rest: when needed
local plan_values = {struct.unpack('<' .. string.rep('d', #plan / 8), plan)}
for i = 1, #plan / 16 do
  call_windows[i], limits[i] = plan_values[2 * i - 1], plan_values[2 * i]
end

--#include _budget_meta.lua  (meta's one-field layout)
--#include _budget_thresholds.lua  (usage-threshold crossings)

-- A new charge is provisional (when asked): it may be undone from `now + hold_ms` on unless
-- confirmed; one that is not provisional takes the id out of pv (an entry left by an
-- earlier charge of the id must never claim this one). pv lives as long as the log may
-- still count the charge, so an unconfirmed charge can never outlive its pv entry.
local function hold(now)
  if not pv_key then return end
  if hold_ms <= 0 then
    redis.call('ZREM', pv_key, request_id)
    return
  end
  redis.call('ZADD', pv_key, now + hold_ms, request_id)
  local longest = call_windows[#call_windows]
  if redis.call('PTTL', pv_key) < longest + margin_ms + hold_ms then
    redis.call('PEXPIRE', pv_key, math.ceil(longest + margin_ms + hold_ms
                                            + math.min(longest, 3600000)))
  end
end

-- (Entitlements on) an operator's override: when `name` (ent's plan) names a plan of the
-- catalog, the call uses that plan: plan_name, call_windows and limits become its. An
-- override naming no plan of the catalog is ignored. Entries ";<name>=<plan>" (names hold
-- no ';' or '=').
local use_override = nil
if dr_key then
  use_override = function(name)
    local catalog = string.match(entitled_arg, '^%S* %d+ %d+ (.*)$') or ''
    local at = string.find(catalog, ';' .. name .. '=', 1, true)
    if not at then return end
    plan_name = name
    local spec = string.match(catalog, '^[^;]*', at + #name + 2)
    local n = 0
    for w, limit in string.gmatch(spec, '(%d+):(%d+)') do
      n = n + 1
      call_windows[n], limits[n] = tonumber(w), tonumber(limit)
    end
    for i = #call_windows, n + 1, -1 do call_windows[i], limits[i] = nil, nil end
  end
end

-- The common case first, in as little Lua as it takes (Redis bills a script by the time it
-- runs): meta holds exactly this plan's windows, at most one event leaves each window, the
-- charge fits without drawing credit and its id is not in the log; with entitlements on,
-- the user's copy is loaded with no suspension in force (an override is applied as the
-- general code applies it), and no event that drew credit leaves a window. It computes what the general code below computes for
-- that case, with meta's numbers in one flat array instead of tables and closures.
-- Anything else is seen before the first write, and the general code starts over.
local packed = redis.call('HGET', meta_key, FIELD)  -- meta's record (the general code too)
do
  -- meta's numbers by position in v (the layout of _budget_meta.lua):
  local CLK = 1      -- the key's clock, ms
  local DEAD = 2     -- events that left every window but are still stored
  local PER = 6      -- numbers per window, after CLK and DEAD, shortest window first
  local BASE = -3    -- window i's numbers are v[k + W] .. v[k + N], k = PER * i + BASE
  local W = 0        -- the window's length, ms
  local T = 1        -- tokens the window counts
  local LO = 2       -- the cursor, ms: every event scored <= it is out of T
  local F = 3        -- score of the oldest event T counts, ms (-1 none, -2 unknown)
  local D = 4        -- tokens drawn from grants by the events T counts
  local N = 5        -- the highest usage threshold already reported, percent
  local fast, epoch, now, nw, size, layout, v = packed ~= false, nil, nil, nil, nil, nil, nil
  local grants_held = nil  -- (entitlements on) ent's ng: '0' = no grants, so credit 0
  if fast then
    size = #packed / 8
    layout = '<' .. string.rep('d', size)
    v = {struct.unpack(layout, packed)}  -- then struct's position (v[size + 1])
    now = math.max(now_arg, v[CLK])
  end
  if fast and dr_key then
    local e = redis.call('HMGET', ent_key, 'epoch', 'plan', 'susp', 'ng')
    local susp = tonumber(e[3])
    epoch = tonumber(e[1])
    fast = epoch ~= nil and not (susp and (susp == 0 or now < susp))
    grants_held = e[4]
    if fast and e[2] and e[2] ~= plan_name then use_override(e[2]) end
  end
  nw = #call_windows
  if fast and size == DEAD + PER * nw then
    for i = 1, nw do
      if not fast then break end
      local k = PER * i + BASE
      local w, t, lo, f = v[k + W], v[k + T], v[k + LO], v[k + F]
      local b = now - w
      if w ~= call_windows[i] or (f == -1 and t ~= 0) then fast = false break end
      if lo < b then
        if f == -2 or (f >= 0 and f <= b) then
          -- the first two events past the cursor: the one leaving, then the first staying
          local items = redis.call('ZRANGEBYSCORE', log_key, '(' .. string.format('%d', lo),
                                   '+inf', 'WITHSCORES', 'LIMIT', '0', '2')
          f = items[2] and tonumber(items[2]) or -1
          if f ~= -1 and f <= b then
            f = items[4] and tonumber(items[4]) or -1
            -- two or more leave, or one whose draws the window counts: the general code
            if (f ~= -1 and f <= b) or v[k + D] > 0 then fast = false break end
            local rec = redis.call('HGET', ev_key, items[1])
            t = t - (rec and tonumber(string.match(rec, '^%d+')) or 0)
            if i == nw then v[DEAD] = v[DEAD] + 1 end  -- out of every window: dead
          end
        end
        v[k + T], v[k + LO], v[k + F] = t, b, f
      elseif f == -2 then
        fast = false break  -- the first event is unknown: looked up there
      end
      -- rejected, or (the quota, t - d, with entitlements on) needing credit: the general code
      if t - (epoch and i == nw and v[k + D] or 0) + cost > limits[i] then
        fast = false break
      end
    end
    if fast then
      local longest, last = call_windows[nw], PER * nw + BASE  -- the longest window, its k
      local due = v[last + F] == -1 or redis.call('PTTL', meta_key) < longest + margin_ms
      if redis.call('ZADD', log_key, 'NX', now, request_id) == 1 then
        redis.call('HSET', ev_key, request_id, record)
        hold(now)
        -- reply: status, retry, binding, (entitlements on: the ent block: nothing drawn,
        -- the live credit, not suspended), then per window used and resets_at
        local out, at = {1, 0, 0}, 3
        if epoch then
          -- the live credit: 0 without grants, else the sum of the unexpired grants'
          -- remaining ("<remaining> <expires_ms or 0> ..." per g:<ref>), read in one pass
          local credit = 0
          if grants_held ~= '0' then
            local raw = redis.call('HGETALL', ent_key)
            for j = 1, #raw, 2 do
              if string.sub(raw[j], 1, 2) == 'g:' then
                local rem, exp = string.match(raw[j + 1], '^(%d+) (%d+)')
                exp = tonumber(exp)
                if rem and (exp == 0 or now < exp) then credit = credit + tonumber(rem) end
              end
            end
          end
          out[4], at = string.format('%d 0 %d -1 %s||', epoch, credit, plan_name), 4
        end
        local thresholds, th_margin = parse_thresholds(threshold_spec)
        local crossed = thresholds and {}
        for i = 1, nw do
          local k = PER * i + BASE
          local t = v[k + T] + cost
          if v[k + F] == -1 then v[k + F] = now end
          v[k + T] = t
          local used = (epoch and i == nw) and t - v[k + D] or t  -- the quota counts t - d
          out[at + 2 * i - 1], out[at + 2 * i] = used, v[k + F] + v[k + W]
          if thresholds then
            v[k + N] = cross(thresholds, th_margin, crossed, i, limits[i], used - cost, used,
                             v[k + N])
          end
        end
        if v[DEAD] >= PURGE or (due and v[DEAD] > 0) then
          purge(v[last + LO])
          v[DEAD] = 0
        end
        v[CLK] = now
        if epoch then  -- and the plan this charge was made under, for the operator's view
          redis.call('HSET', meta_key, FIELD, struct.pack(layout, unpack(v, 1, size)),
                     'lp', string.format('%d %s', now, plan_name))
        else
          redis.call('HSET', meta_key, FIELD, struct.pack(layout, unpack(v, 1, size)))
        end
        if due then renew_expiry(longest + margin_ms + math.min(longest, 3600000)) end
        if crossed then
          for i = 1, #crossed do out[#out + 1] = crossed[i] end
        end
        return out
      end
    end
  end
end

local nonce = string.match(record, '^%d+ (%S+)')  -- this call's, as the ev records hold it
--#include _budget_windows.lua  (the window bookkeeping shared with the other budget scripts)
local entitled = dr_key ~= nil
--#include _budget_grants.lua  (entitlements and draws)

-- The wait is found by walking the window's oldest events until they free `need` tokens.
-- Every event costs at least 1 token, so `need` tokens are freed within the `need` oldest
-- events: each batch reads at most the events still possibly needed (need - freed, at most
-- BATCH), so a small request reads few events and a large one walks in large batches.
-- The walk is exact up to MAX_WALK events. Past that (a cost, or an excess over a lowered
-- limit, of more than MAX_WALK tokens in events of a few tokens each) it stops reading
-- costs and answers as if every unread event cost exactly 1 token: when the event at rank
-- walked + (need - freed) leaves. Unread events cost at least 1, so the true wait is never
-- later than that answer: it may be late, never early. This runs only on rejection.
local MAX_WALK = 10000

-- How long until enough of the oldest events leave window w to free `need` tokens, ms.
-- An event scored s leaves the window at s + w exactly (cursors take scores <= now - w).
-- For the quota window (`quota` true) an event frees only its quota part, cost minus what it
-- drew from grants; a part may be 0, so past MAX_WALK the answer is the newest event's exit.
local function wait_ms(now, w, need, quota)
  local start = count_upto(now - w)  -- rank of the oldest event the window counts
  local freed, walked = 0, 0
  while walked < MAX_WALK do
    local size = math.min(need - freed, BATCH, MAX_WALK - walked)
    local items = redis.call('ZRANGE', log_key, start + walked, start + walked + size - 1,
                             'WITHSCORES')
    if #items == 0 then break end
    local ids, scores = {}, {}
    for i = 1, #items, 2 do
      ids[#ids + 1] = items[i]
      scores[#scores + 1] = tonumber(items[i + 1])
    end
    local recs = redis.call('HMGET', ev_key, unpack(ids))
    local drs = quota and redis.call('HMGET', dr_key, unpack(ids)) or {}
    for i = 1, #recs do
      freed = freed + record_cost(recs[i]) - (quota and record_drawn(drs[i]) or 0)
      if freed >= need then return scores[i] + w - now end
    end
    walked = walked + #ids
    if #ids < size then break end
  end
  if walked >= MAX_WALK and not quota then
    -- the bound described above: the event that frees `need` if the rest cost 1 each
    local bound = redis.call('ZRANGE', log_key, start + walked + need - freed - 1,
                             start + walked + need - freed - 1, 'WITHSCORES')
    if #bound > 0 then return math.max(1, tonumber(bound[2]) + w - now) end
  end
  -- defensive (cost <= limit, so the window's events free enough unless records are
  -- missing), and the quota walk's bound: wait until the window is empty
  local newest = redis.call('ZRANGE', log_key, -1, -1, 'WITHSCORES')
  if #newest == 0 then return w end
  return math.max(1, tonumber(newest[2]) + w - now)
end

local ent = nil        -- the user's entitlements (entitlements on only)
local nw = #call_windows
local quota_w = nil    -- the quota window, ms (entitlements on only)
local draws = nil      -- this charge's draws, {ref, n} in draw order (entitlements on)
local drawn = 0
local credit = -1      -- live credit after the call; -1 = not read
local draw_epoch = 0   -- the epoch of the draws reported
local credit_events = nil  -- (entitlements on) credit crossings of this charge
local susp_out = -1

-- Entitlements only (nil when off: a closure or a table costs Redis time on every call).
local ent_block, charged_by_this_call = nil, nil
if dr_key then

ent_block = function()
  local out = string.format('%d %d %d %d %s|', draw_epoch, drawn, credit, susp_out, plan_name)
  if draws then
    local items = {}
    for i, d in ipairs(draws) do items[i] = d[1] .. '=' .. string.format('%d', d[2]) end
    out = out .. table.concat(items, ' ')
  end
  out = out .. '|'
  if credit_events then
    local items = {}
    for i, e in ipairs(credit_events) do
      items[i] = string.format('%s %d %d %s %s', e[2], e[3], e[4], e[5], e[1])
    end
    out = out .. table.concat(items, ';')
  end
  return out
end

-- A re-send of this very call that already charged (its reply was lost) is answered as that
-- charge even when the user has since been suspended, invalidated or moved to a plan the
-- cost exceeds: the caller must learn of the charge (to refund it), not be told "nothing".
charged_by_this_call = function()
  if not redis.call('ZSCORE', log_key, request_id) then return false end
  local rec = redis.call('HGET', ev_key, request_id)
  return rec and string.match(rec, '^%d+ (%S+)') == nonce
end

end

local resent = false
if dr_key then
  ent = G.load_ent(ent_key)
  if not ent.epoch then
    resent = charged_by_this_call()
    if not resent then return {4, 0, 0, ent_block()} end
  end
  draw_epoch = ent.epoch or 0
end

local m = load_meta(packed)
local now = math.max(now_arg, m.clk)

if ent then
  if ent.susp and (ent.susp == 0 or now < ent.susp) then
    resent = resent or charged_by_this_call()
    if not resent then
      susp_out = ent.susp
      return {3, 0, 0, ent_block()}
    end
  end
  if ent.plan and ent.plan ~= plan_name then
    use_override(ent.plan)
    nw = #call_windows
  end
  -- a cost above a shorter window's limit never fits (above the quota's: below)
  for i = 1, nw - 1 do
    if cost > limits[i] and not resent then
      resent = charged_by_this_call()
      if not resent then return {5, 0, i, ent_block()} end
    end
  end
  quota_w = call_windows[nw]
end

local longest = advance(m, now, call_windows)

-- A cost above the quota's limit: credit pays the part beyond it, cost - Q at least, so a
-- user whose live credit is short of that is refused (5) unless the id is charged already
-- (a re-send or a duplicate, answered below). Nothing was written yet.
if quota_w and cost > limits[nw] then
  local _, avail = G.more().live_grants(ent, now)
  if avail < cost - limits[nw] and not live_score(m, longest, request_id) then
    credit = avail
    return {5, 0, nw, ent_block()}
  end
end

-- (quota_w is nil with entitlements off: every window counts full costs)
local function reply(status, retry, binding)
  local out = {status, retry, binding}
  if ent then out[4] = ent_block() end
  for _, w in ipairs(call_windows) do
    local s = m.windows[w]
    out[#out + 1] = w == quota_w and s.total - s.drawn or s.total
    out[#out + 1] = resets_at(m, w)
  end
  return out
end

local fits, quota_short = true, false
for i, w in ipairs(call_windows) do
  if w == quota_w then
    local s = m.windows[w]
    local need = s.total - s.drawn + cost - limits[i]
    if need > 0 then
      local want = math.min(need, cost)
      local live, avail = G.more().live_grants(ent, now)
      credit = avail
      if avail < want then
        fits, quota_short = false, true
      else
        for _, g in ipairs(live) do
          if want == 0 then break end
          local n = math.min(want, g.remaining)
          if n > 0 then
            draws = draws or {}
            draws[#draws + 1] = {g.ref, n, g}
            want = want - n
            drawn = drawn + n
          end
        end
      end
    end
  elseif m.windows[w].total + cost > limits[i] then
    fits = false
  end
end
if ent and not fits and credit < 0 then
  local _, avail = G.more().live_grants(ent, now)
  credit = avail
end

-- An id whose event has left every window but is still stored (deleted in batches) is no
-- charge any more: it goes now, and the id may be charged again.
local function added()
  if redis.call('ZADD', log_key, 'NX', now, request_id) == 1 then return true end
  if live_score(m, longest, request_id) then return false end
  redis.call('HDEL', ev_key, request_id)
  if dr_key then redis.call('HDEL', dr_key, request_id) end
  redis.call('ZADD', log_key, now, request_id)
  m.dead = math.max(0, m.dead - 1)
  return true
end

if fits then
  -- NX: an id already counted keeps its charge (a duplicate, answered below)
  if added() then
    redis.call('HSET', ev_key, request_id, record)
    hold(now)
    if drawn > 0 then
      -- the draws become real: remaining, credit crossings, the dr record, every d:<W>
      local low = tonumber(string.match(entitled_arg, '^%S* (%d+)'))
      local fields = {}
      for _, d in ipairs(draws) do
        local g, n = d[3], d[2]
        local before = g.remaining
        g.remaining = before - n
        if not string.find(g.flags, 'l', 1, true) and before * 100 > low * g.tokens
            and g.remaining * 100 <= low * g.tokens then
          g.flags = g.flags .. 'l'
          credit_events = credit_events or {}
          credit_events[#credit_events + 1] = {g.ref, 'low', g.remaining, g.tokens, g.kind}
        end
        if g.remaining == 0 and not string.find(g.flags, 'x', 1, true) then
          g.flags = g.flags .. 'x'
          credit_events = credit_events or {}
          credit_events[#credit_events + 1] = {g.ref, 'exhausted', 0, g.tokens, g.kind}
        end
        fields[#fields + 1] = 'g:' .. g.ref
        fields[#fields + 1] = G.more().grant_value(g)
        d[3] = nil
      end
      redis.call('HSET', ent_key, unpack(fields))
      redis.call('HSET', dr_key, request_id, G.more().encode_draws(ent.epoch, draws))
      redis.call('PEXPIRE', dr_key, int(longest + margin_ms + math.min(longest, 3600000)))
      credit = credit - drawn
      for _, s in pairs(m.windows) do s.drawn = s.drawn + drawn end
    elseif ent then
      local _, avail = G.more().live_grants(ent, now)
      credit = avail
    end
    for _, s in pairs(m.windows) do
      s.total = s.total + cost
      if s.first == NONE then s.first = now end
    end
    -- usage thresholds crossed (the quota window counts t - d and the undrawn part)
    local crossed = {}
    local thresholds, th_margin = parse_thresholds(threshold_spec)
    if thresholds then
      for i, w in ipairs(call_windows) do
        local s = m.windows[w]
        local after, charged = s.total, cost
        if w == quota_w then after, charged = after - s.drawn, cost - drawn end
        s.level = cross(thresholds, th_margin, crossed, i, limits[i], after - charged, after,
                        s.level)
      end
    end
    save_meta(m, now, longest)
    if ent then redis.call('HSET', meta_key, 'lp', string.format('%d %s', now, plan_name)) end
    local out = reply(1, 0, 0)
    for i = 1, #crossed do out[#out + 1] = crossed[i] end
    return out
  end
elseif not live_score(m, longest, request_id) then
  local retry, binding = 0, 0
  for i, w in ipairs(call_windows) do
    local total = m.windows[w].total
    if w == quota_w then total = total - m.windows[w].drawn end
    -- the quota fails only when the grants could not cover what it lacks
    if total + cost > limits[i] and (w ~= quota_w or quota_short) then
      local quota = w == quota_w and m.windows[w].drawn > 0
      local free = total + cost - limits[i]
      -- a cost above the quota never fits it alone: wait until the credit covers the rest
      if w == quota_w and cost > limits[i] then free = free - credit end
      local wait = wait_ms(now, w, free, quota)
      if wait > retry then retry, binding = wait, i end
    end
  end
  save_meta(m, now, longest)
  draws, drawn = nil, 0  -- nothing drawn for a rejected charge
  return reply(0, retry, binding)
end

-- the id is already charged: by this very call (a client re-send) or by another one
save_meta(m, now, longest)
local rec = redis.call('HGET', ev_key, request_id)
local same_call = rec and string.match(rec, '^%d+ (%S+)') == nonce
draws, drawn = nil, 0
if ent then credit = -1 end
if ent and same_call then
  -- a re-send: report the draws its first run made, nothing drawn now, and the credit
  local epoch, list = G.more().parse_draws(redis.call('HGET', dr_key, request_id))
  if epoch then
    draws, draw_epoch = list, epoch
    for _, d in ipairs(list) do drawn = drawn + d[2] end
  end
  local _, avail = G.more().live_grants(ent, now)
  credit = avail
end
return reply(same_call and 1 or 2, 0, 0)
