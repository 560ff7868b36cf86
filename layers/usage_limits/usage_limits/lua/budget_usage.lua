--[[ budget_usage.lua: a user's current spend per window and the most recent spend events.

Moves every window's running total up to now exactly as budget_reserve.lua does (the code
between the BEGIN/END lines is the same in both files; a unit test checks it), so reading
usage also retires expired events. A user with no keys gets zeros and nothing is written.
Run twice, the second run finds every window already at now and answers the same.

KEYS[1]  log         zset: member = request id, score = time of the charge, ms since the epoch
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>" (cost in tokens)
KEYS[3]  meta        hash: clk (ms), t:<W> (tokens), lo:<W> (ms), f:<W> (ms or -1);
                     see budget_reserve.lua
ARGV[1]  now_ms      caller's clock, ms since the epoch (integer)
ARGV[2]  max_events  how many of the most recent events to return (integer >= 0)
ARGV[3]  margin_ms   keys live this long past the longest window, ms (integer >= 0)
ARGV[4.. ] window_ms lengths of the windows to report, ms, shortest first

With entitlements on (KEYS[4] and KEYS[5] given; see _budget_grants.lua) the arguments from
ARGV[4] on are instead:
KEYS[4]  ent         hash: epoch, plan, susp, g:<reference> (the user's entitlements)
KEYS[5]  dr          hash: request id -> "#<epoch> <ref>=<n> ..." (draws of each charge)
ARGV[4]  plan_name   the caller's plan, used unless ent.plan names a plan of the catalog
ARGV[5]  catalog     ";<name>=<plan>;...", each <plan> "<window_ms>:<limit> ..." (or '')
ARGV[6.. ] window_ms the caller's plan's window lengths, ms, shortest first
and the reply has the entitlements after now_ms, the quota window (the plan's longest)
counts t - d (what grants did not cover), and every event has its dr record after it:
  {now_ms, {plan used, epoch (0 = not loaded), suspended until (ms, 0 = until lifted, -1 =
   not suspended), {live grants in draw order: ref, remaining, tokens, expires_ms (0 =
   never), kind, ...}, last charge ("<ms> <plan>" of meta's lp, '' = unknown)}, used_1,
   resets_at_ms_1, ..., then per event: request_id, at_ms, record, draws ("#<epoch>
   <ref>=<n> ..." or false)}

Returns {now_ms, used_1, resets_at_ms_1, used_2, resets_at_ms_2, ...,
         then per event, most recent first: request_id, at_ms, record}
  now_ms        the clock used: max(ARGV now_ms, clk)
  used          tokens in the window now
  resets_at_ms  when the oldest counted event leaves the window, ms; -1 when it is empty
  at_ms         (string) the event's time, ms since the epoch
  record        (string) "<cost> <nonce> <route>", or false if the record is missing
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]

local now_arg = tonumber(ARGV[1])
local max_events = tonumber(ARGV[2])
local margin_ms = tonumber(ARGV[3])
local ent_key = KEYS[4]
local dr_key = KEYS[5]
local plan_name = dr_key and ARGV[4] or ''
local catalog = dr_key and ARGV[5] or ''
local call_windows = {}
for i = dr_key and 6 or 4, #ARGV do call_windows[#call_windows + 1] = tonumber(ARGV[i]) end

--#include _budget_meta.lua  (meta's one-field layout)
--#include _budget_windows.lua  (the window bookkeeping shared with the other budget scripts)
local entitled = dr_key ~= nil
--#include _budget_grants.lua  (entitlements and draws)

local ent, quota_w, head = nil, nil, nil
if dr_key then
  ent = G.load_ent(ent_key)
  if ent.plan and ent.plan ~= plan_name then
    for name, spec in string.gmatch(catalog, '([^;=]+)=([^;]*)') do
      if name == ent.plan then
        plan_name = name
        call_windows = {}
        for w in string.gmatch(spec, '(%d+):%d+') do
          call_windows[#call_windows + 1] = tonumber(w)
        end
        break
      end
    end
  end
  quota_w = call_windows[#call_windows]
  -- the entitlements part of the reply, at `now`
  head = function(now)
    local live = G.more().live_grants(ent, now)
    local flat = {}
    for _, g in ipairs(live) do
      flat[#flat + 1] = g.ref
      flat[#flat + 1] = g.remaining
      flat[#flat + 1] = g.tokens
      flat[#flat + 1] = g.expires
      flat[#flat + 1] = g.kind
    end
    local susp = -1
    if ent.susp and (ent.susp == 0 or now < ent.susp) then susp = ent.susp end
    return {plan_name, ent.epoch or 0, susp, flat, redis.call('HGET', meta_key, 'lp') or ''}
  end
end

if redis.call('EXISTS', log_key, meta_key) == 0 then
  local out = {now_arg}
  if head then out[2] = head(now_arg) end
  for _ = 1, #call_windows do
    out[#out + 1] = 0
    out[#out + 1] = -1
  end
  return out
end

local m = load_meta()
local now = math.max(now_arg, m.clk)
local longest = advance(m, now, call_windows)
save_meta(m, now, longest, true)  -- all dead events go: the events listed below are live

local out = {now}
if head then out[2] = head(now) end
for _, w in ipairs(call_windows) do
  local s = m.windows[w]
  out[#out + 1] = w == quota_w and s.total - s.drawn or s.total
  out[#out + 1] = resets_at(m, w)
end
if max_events > 0 then
  local items = redis.call('ZRANGE', log_key, 0, max_events - 1, 'REV', 'WITHSCORES')
  if #items > 0 then
    local ids = {}
    for i = 1, #items, 2 do ids[#ids + 1] = items[i] end
    local recs = redis.call('HMGET', ev_key, unpack(ids))
    local drs = dr_key and redis.call('HMGET', dr_key, unpack(ids))
    for i = 1, #ids do
      out[#out + 1] = ids[i]
      out[#out + 1] = items[2 * i]
      out[#out + 1] = recs[i]
      if drs then out[#out + 1] = drs[i] end
    end
  end
end
return out
