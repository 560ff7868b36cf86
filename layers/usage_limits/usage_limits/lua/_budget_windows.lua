--[[ _budget_windows.lua: the window bookkeeping shared by budget_reserve.lua and
budget_usage.lua. Not a script of its own: LuaScript pastes it where a script says
`--#include _budget_windows.lua`, so both scripts run the very same code.

Needs _budget_meta.lua pasted before it (meta's layout is described there). With
entitlements on, the including script sets dr_key (the user's draws hash: request id ->
"#<epoch> <ref>=<n> ..."), and every window also keeps d, the tokens drawn from grants by
the events it counts: subtracted as events leave, counted from dr for a new window. dr_key
nil (entitlements off) reads and writes nothing of it.
]]
local BATCH = 500 -- ids per ZRANGE/HMGET/HDEL call (stays far below Lua's unpack limit)
local PEEK = '2'  -- events read past a cursor that moves: one leaving, then the first staying

-- Integers as plain digits: Lua would print large numbers as 1.7e+12.
local function int(x) return string.format('%d', x) end

-- Cost of one "<cost> <nonce> <route>" record; a missing record counts 0.
local function record_cost(rec)
  if not rec then return 0 end
  return tonumber(string.match(rec, '^%d+')) or 0
end

-- Tokens drawn from grants by one dr record ("#<epoch> <ref>=<n> ..."); none counts 0.
-- Defined only with entitlements on (dr_key): a closure costs Redis time on every call.
local record_drawn = nil
if dr_key then
  record_drawn = function(rec)
    if not rec then return 0 end
    local total = 0
    for n in string.gmatch(rec, ' %S+=(%d+)') do total = total + tonumber(n) end
    return total
  end
end

-- Number of events scored <= ms, which is also the rank of the first event after ms.
local function count_upto(ms)
  return redis.call('ZCOUNT', log_key, '-inf', int(ms))
end

-- Ids of the events scored in (lo, hi], oldest first. One call when fewer than BATCH; a
-- long pause continues by rank, so a large range is never re-walked from its start.
local function ids_between(lo, hi)
  local ids = redis.call('ZRANGEBYSCORE', log_key, '(' .. int(lo), int(hi), 'LIMIT', '0', BATCH)
  if #ids < BATCH then return ids end
  local last = count_upto(hi) - 1
  for start = count_upto(lo) + BATCH, last, BATCH do
    local more = redis.call('ZRANGE', log_key, start, math.min(start + BATCH - 1, last))
    for i = 1, #more do ids[#ids + 1] = more[i] end
  end
  return ids
end

-- Sum of the current costs of the given events.
local function sum_costs(ids)
  local total = 0
  for start = 1, #ids, BATCH do
    local stop = math.min(start + BATCH - 1, #ids)
    local recs = redis.call('HMGET', ev_key, unpack(ids, start, stop))
    for i = 1, #recs do total = total + record_cost(recs[i]) end
  end
  return total
end

-- Tokens drawn by the given events (entitlements on only; nil when off).
local sum_drawn = nil
if dr_key then
  sum_drawn = function(ids)
    if #ids == 0 then return 0 end
    local total = 0
    for start = 1, #ids, BATCH do
      local stop = math.min(start + BATCH - 1, #ids)
      local recs = redis.call('HMGET', dr_key, unpack(ids, start, stop))
      for i = 1, #recs do total = total + record_drawn(recs[i]) end
    end
    return total
  end
end

-- Ids of the events in (s.lo, b], which leave window s as its cursor moves to b; learns
-- s.first on the way. One call unless PEEK or more events leave at once.
local function leaving(s, b)
  local items = redis.call('ZRANGEBYSCORE', log_key, '(' .. int(s.lo), '+inf', 'WITHSCORES',
                           'LIMIT', '0', PEEK)
  local ids = {}
  for i = 1, #items, 2 do
    local score = tonumber(items[i + 1])
    if score > b then
      s.first = score
      return ids
    end
    ids[#ids + 1] = items[i]
  end
  if #items < 2 * tonumber(PEEK) then
    s.first = NONE
    return ids
  end
  s.first = nil
  return ids_between(s.lo, b)
end

-- The score of the first event scored above lo, ms; NONE when there is none.
local function first_after(lo)
  local first = redis.call('ZRANGEBYSCORE', log_key, '(' .. int(lo), '+inf', 'WITHSCORES',
                           'LIMIT', '0', '1')
  return #first == 0 and NONE or tonumber(first[2])
end

-- Bring every window the user has (and every window of this call) up to `now`. Events that
-- leave the longest window have left every window: they are counted in m.dead and deleted
-- later, PURGE at a time (save_meta), not one by one on every call. Sets m.empty when the
-- longest window counts no event, before this call's charge. Returns the longest window, ms.
local function advance(m, now, wanted)
  local ws = m.ws
  local kept_longest = ws[#ws]
  local added = false
  for _, w in ipairs(wanted) do
    if not m.windows[w] then
      -- First use of this window by this user (a plan change, or a meta without m): count
      -- what the log still holds, once. This one call costs O(events in the window); later
      -- calls do not.
      local lo
      if not kept_longest or w > kept_longest then
        -- Longer than every window kept so far: it takes over counting what leaves the log.
        -- It counts every event not yet out of every window (scored above the longest
        -- kept window's cursor, or all of the log), with its cursor there: the loop below
        -- then subtracts those already older than this window.
        lo = kept_longest and m.windows[kept_longest].lo or -1
      else
        lo = now - w
      end
      local ids = ids_between(lo, now)
      m.windows[w] = {total = sum_costs(ids), lo = lo, drawn = sum_drawn and sum_drawn(ids) or 0,
                      level = 0}
      ws[#ws + 1] = w
      added = true
    end
  end
  if added then table.sort(ws) end
  -- Shortest first: after a long pause a shorter window subtracts the events that leave it
  -- before the longest one counts them as dead.
  local longest = ws[#ws]
  for _, w in ipairs(ws) do
    local s, b = m.windows[w], now - w
    if s.lo < b then
      if not (s.first and s.first > b) then
        -- events in (lo, b] have left the window since the last call: subtract each once
        local gone = leaving(s, b)
        if #gone > 0 then
          s.total = s.total - sum_costs(gone)
          -- with no drawn tokens in the window, no leaving event has a dr record
          if sum_drawn and s.drawn > 0 then s.drawn = math.max(0, s.drawn - sum_drawn(gone)) end
          if w == longest then m.dead = m.dead + #gone end
        end
      end
      s.lo = b
    end
  end
  local s = m.windows[longest]
  if not s.first then s.first = first_after(s.lo) end
  m.empty = s.first == NONE
  return longest
end

-- The score of request id's event while some window may still count it (above the longest
-- window's cursor); nil when it is not in the log or has left every window. After advance.
local function live_score(m, longest, id)
  local score = redis.call('ZSCORE', log_key, id)
  if score and tonumber(score) > m.windows[longest].lo then return tonumber(score) end
  return nil
end

-- Store meta, after looking up each window's unknown first event, and delete the dead events
-- once PURGE of them have gathered (all of them with `all`, or when the expiry is renewed).
-- Every key lives at least margin_ms past the longest window: when meta's expiry (PTTL,
-- Redis's own clock) would fall short of that, or when this call may have made a key anew
-- (the longest window counted no event, so log and ev may have been deleted), every expiry is
-- set to longest + margin_ms + slack, slack = min(longest, 1 h). An active user's keys so get
-- PEXPIRE about once per slack instead of on every call, and an idle user's vanish at most
-- slack later than they used to.
local function save_meta(m, now, longest, all)
  m.clk = now
  local due = m.empty or m.fresh or redis.call('PTTL', meta_key) < longest + margin_ms
  for _, w in ipairs(m.ws) do
    local s = m.windows[w]
    if not s.first then s.first = first_after(s.lo) end
  end
  if m.dead >= PURGE or (m.dead > 0 and (due or all)) then
    purge(m.windows[longest].lo)
    m.dead = 0
  end
  if m.fresh then redis.call('DEL', meta_key) end  -- the fields of an older layout, if any
  redis.call('HSET', meta_key, FIELD, encode_meta(m))
  if due then renew_expiry(longest + margin_ms + math.min(longest, 3600000)) end
end

-- When the oldest event window w counts leaves it (-1 when it counts none: nothing to wait
-- for); after save_meta.
local function resets_at(m, w)
  local first = m.windows[w].first
  if first == NONE then return -1 end
  return first + w
end
