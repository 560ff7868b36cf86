--[[ _budget_windows.lua: the window bookkeeping shared by budget_reserve.lua and
budget_usage.lua. Not a script of its own: LuaScript pastes it where a script says
`--#include _budget_windows.lua`, so both scripts run the very same code.

With entitlements on, the including script sets dr_key (the user's draws hash: request id ->
"#<epoch> <ref>=<n> ..."), and every window also keeps d:<W>, the tokens drawn from grants by
the events it counts: subtracted as events leave, counted from dr for a new window. dr_key
nil (entitlements off) reads and writes nothing of it.
]]
local BATCH = 500 -- ids per ZRANGE/HMGET/HDEL call (stays far below Lua's unpack limit)
local PEEK = '3'  -- events read past a cursor that moves: those leaving, then the first staying
local NONE = math.huge -- first event of a window that counts none (f:<W> = -1)

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

-- meta as {clk = ms, windows = {[W] = {total = tokens, lo = ms, first = ms or NONE or nil,
-- drawn = tokens or nil (0), was = the same as stored}}}; half-known windows dropped.
-- first (f:<W>) is the score of the oldest event the window
-- counts: no event lies between the cursor and it, so a cursor that stays below it passes
-- no event. nil when unknown (a refund removed that event, or a new window); NONE is
-- trusted only with a zero total.
local function load_meta()
  local flat = redis.call('HGETALL', meta_key)
  local m = {clk = 0, windows = {}}
  local totals, cursors, firsts, drawn = {}, {}, {}, nil  -- drawn: only if any d:<W>
  for i = 1, #flat, 2 do
    local field, value = flat[i], flat[i + 1]
    if field == 'clk' then m.clk = tonumber(value)
    else
      local kind, w = string.match(field, '^(%a+):(%d+)$')
      if kind == 't' then totals[w] = tonumber(value)
      elseif kind == 'lo' then cursors[w] = tonumber(value)
      elseif kind == 'f' then firsts[w] = value == '-1' and NONE or tonumber(value)
      elseif kind == 'd' then
        drawn = drawn or {}
        drawn[w] = tonumber(value)
      end
    end
  end
  for w, total in pairs(totals) do
    if cursors[w] then
      local first = firsts[w]
      if first == NONE and total ~= 0 then first = nil end
      local stored = {total = total, lo = cursors[w], first = firsts[w]}
      local s = {total = total, lo = cursors[w], first = first, was = stored}
      local d = drawn and drawn[w]  -- nil when absent (entitlements off: always)
      if d then stored.drawn, s.drawn = d, d end
      m.windows[tonumber(w)] = s
    end
  end
  return m
end

-- Ids of the events in (s.lo, b], which leave window s as its cursor moves to b; learns
-- s.first on the way. One call unless more than PEEK events leave at once.
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

-- Bring every window the user has (and every window of this call) up to `now`, then drop the
-- events older than the longest one. Sets m.empty when the longest window counts no event (or
-- may not), before this call's charge. Returns the longest window, ms.
local function advance(m, now, wanted)
  local kept_longest = 0
  for w in pairs(m.windows) do kept_longest = math.max(kept_longest, w) end
  for _, w in ipairs(wanted) do
    if not m.windows[w] then
      -- First use of this window by this user (a plan change): count what the log still
      -- holds, once. This one call costs O(events in the window); later calls do not.
      if w > kept_longest then
        -- Longer than every window kept so far: it takes over deleting what leaves the
        -- log. The log holds only events of the shorter windows, so count all of it with
        -- the cursor below every event: the loop below then subtracts and deletes those
        -- already older than this window (they are out of every window).
        local ids = ids_between(-1, now)
        m.windows[w] = {total = sum_costs(ids), lo = -1,
                        drawn = sum_drawn and sum_drawn(ids) or nil}
      else
        local b = now - w
        local ids = ids_between(b, now)
        m.windows[w] = {total = sum_costs(ids), lo = b, drawn = sum_drawn and sum_drawn(ids) or nil}
      end
    end
  end
  -- Shortest first: the longest window deletes what leaves it, and after a long pause a
  -- shorter window must first subtract those same events.
  local lengths = {}
  for w in pairs(m.windows) do lengths[#lengths + 1] = w end
  table.sort(lengths)
  local longest = lengths[#lengths]
  for _, w in ipairs(lengths) do
    local s, b = m.windows[w], now - w
    if s.lo < b then
      if not (s.first and s.first > b) then
        -- events in (lo, b] have left the window since the last call: subtract each once
        local gone = leaving(s, b)
        s.total = s.total - sum_costs(gone)
        -- with no drawn tokens in the window, no leaving event has a dr record
        local drew = sum_drawn and (s.drawn or 0) > 0
        if drew then s.drawn = math.max(0, s.drawn - sum_drawn(gone)) end
        if w == longest and #gone > 0 then
          -- they have left every window (each cursor is past them): delete them
          for start = 1, #gone, BATCH do
            redis.call('HDEL', ev_key, unpack(gone, start, math.min(start + BATCH - 1, #gone)))
            if drew then
              redis.call('HDEL', dr_key, unpack(gone, start, math.min(start + BATCH - 1, #gone)))
            end
          end
          redis.call('ZREMRANGEBYSCORE', log_key, '-inf', int(b))
        end
      end
      s.lo = b
    end
  end
  local first = m.windows[longest].first
  m.empty = first == nil or first == NONE
  return longest
end

-- Store the clock and what changed of each window's total, cursor and first event (looked
-- up if unknown). Every key lives at least margin_ms past the longest window: when meta's
-- expiry (PTTL, Redis's own clock) would fall short of that, or when this call may have made
-- a key anew (the longest window counted no event, so log and ev may have been empty), every
-- expiry is set to longest + margin_ms + slack, slack = min(longest, 1 h). An active user's
-- keys so get PEXPIRE about once per slack instead of on every call, and an idle user's
-- vanish at most slack later than they used to.
local function save_meta(m, now, longest)
  local fields = {'clk', int(now)}
  local due = m.empty or redis.call('PTTL', meta_key) < longest + margin_ms
  local ttl = longest + margin_ms + math.min(longest, 3600000)
  for w, s in pairs(m.windows) do
    if not s.first then
      local first = redis.call('ZRANGEBYSCORE', log_key, '(' .. int(s.lo), '+inf',
                               'WITHSCORES', 'LIMIT', '0', '1')
      s.first = #first == 0 and NONE or tonumber(first[2])
    end
    local tag, was = int(w), s.was or {}
    if s.total ~= was.total then
      fields[#fields + 1] = 't:' .. tag
      fields[#fields + 1] = int(s.total)
    end
    if s.lo ~= was.lo then
      fields[#fields + 1] = 'lo:' .. tag
      fields[#fields + 1] = int(s.lo)
    end
    if s.first ~= was.first then
      fields[#fields + 1] = 'f:' .. tag
      fields[#fields + 1] = s.first == NONE and '-1' or int(s.first)
    end
    if (s.drawn or 0) ~= (was.drawn or 0) then
      fields[#fields + 1] = 'd:' .. tag
      fields[#fields + 1] = int(s.drawn or 0)
    end
  end
  redis.call('HSET', meta_key, unpack(fields))
  if due then
    redis.call('PEXPIRE', log_key, int(ttl))
    redis.call('PEXPIRE', ev_key, int(ttl))
    redis.call('PEXPIRE', meta_key, int(ttl))
    if dr_key then
      redis.call('PEXPIRE', ent_key, int(ttl), 'GT')  -- never shortens a load's expiry
      redis.call('PEXPIRE', dr_key, int(ttl))
    end
  end
end

-- When the oldest event window w counts leaves it (-1 when it counts none: nothing to wait
-- for); after save_meta.
local function resets_at(m, w)
  local first = m.windows[w].first
  if first == NONE then return -1 end
  return first + w
end
