--[[ budget_reserve.lua: charge one request to a user's token budget if it fits every window.

The ledger keeps a running total per window instead of summing the window: each call moves
every window's cursor up to its new boundary and subtracts only the events that crossed it,
so each event is subtracted once per window and a call costs O(log N + expired events).

KEYS[1]  log         zset: member = request id, score = time of the charge, ms since the epoch
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>" (cost in tokens)
KEYS[3]  meta        hash:  clk    latest clock seen, ms (the key's clock never runs back)
                            t:<W>  tokens counted in the window of W ms
                            lo:<W> cursor, ms: every event scored <= lo:<W> is out of t:<W>
ARGV[1]  now_ms      caller's clock, ms since the epoch (integer)
ARGV[2]  request_id  the charge's id (printable, at most 256 characters)
ARGV[3]  cost        tokens to charge (integer >= 1)
ARGV[4]  nonce       random per call, no spaces: tells a client's re-send of this very call
                     (same nonce) from a second reservation of the same id (other nonce)
ARGV[5]  route       route recorded with the charge (audit trail), may be empty
ARGV[6]  margin_ms   keys live this long past the longest window, ms (integer >= 0)
ARGV[7.. ] window_ms, limit pairs, shortest window first: window length in ms, limit in tokens

Returns {allowed, duplicate, retry_after_ms, now_ms, then per ARGV window:
         used, resets_at_ms, retry_ms}
  allowed         1 when the request is charged (or was, by this same call), else 0
  duplicate       1 when the id was already charged by another call: nothing charged now
  retry_after_ms  0 when allowed; else when enough old events leave every failing window
  now_ms          the clock used: max(ARGV now_ms, clk)
  used            tokens in the window after this call
  resets_at_ms    when the oldest counted event leaves the window (now_ms when it is empty)
  retry_ms        0 when the window has room, else its own wait
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]

local now_arg = tonumber(ARGV[1])
local request_id = ARGV[2]
local cost = tonumber(ARGV[3])
local nonce = ARGV[4]
local route = ARGV[5]
local margin_ms = tonumber(ARGV[6])
local call_windows, limits = {}, {}
for i = 7, #ARGV, 2 do
  call_windows[#call_windows + 1] = tonumber(ARGV[i])
  limits[#limits + 1] = tonumber(ARGV[i + 1])
end

-- BEGIN shared ledger code (identical in budget_reserve.lua and budget_usage.lua) --------
local BATCH = 500 -- ids per ZRANGE/HMGET/HDEL call (stays far below Lua's unpack limit)

-- Integers as plain digits: Lua would print large numbers as 1.7e+12.
local function int(x) return string.format('%d', x) end

-- Cost of one "<cost> <nonce> <route>" record; a missing record counts 0.
local function record_cost(rec)
  if not rec then return 0 end
  return tonumber(string.match(rec, '^%d+')) or 0
end

-- Number of events scored <= ms, which is also the rank of the first event after ms.
local function count_upto(ms)
  return redis.call('ZCOUNT', log_key, '-inf', int(ms))
end

-- Sum of the current costs of the events ranked first..last (0-based, inclusive).
local function sum_ranks(first, last)
  local total = 0
  for start = first, last, BATCH do
    local ids = redis.call('ZRANGE', log_key, start, math.min(start + BATCH - 1, last))
    if #ids > 0 then
      local recs = redis.call('HMGET', ev_key, unpack(ids))
      for i = 1, #recs do total = total + record_cost(recs[i]) end
    end
  end
  return total
end

-- meta as {clk = ms, windows = {[W] = {total = tokens, lo = ms}}}; half-known windows dropped.
local function load_meta()
  local flat = redis.call('HGETALL', meta_key)
  local m = {clk = 0, windows = {}}
  local totals, cursors = {}, {}
  for i = 1, #flat, 2 do
    local field, value = flat[i], tonumber(flat[i + 1])
    local kind, w = string.match(field, '^(%a+):(%d+)$')
    if field == 'clk' then m.clk = value
    elseif kind == 't' then totals[tonumber(w)] = value
    elseif kind == 'lo' then cursors[tonumber(w)] = value end
  end
  for w, total in pairs(totals) do
    if cursors[w] then m.windows[w] = {total = total, lo = cursors[w]} end
  end
  return m
end

-- Bring every window the user has (and every window of this call) up to `now`, then drop the
-- events older than the longest one. Returns the longest window, ms.
local function advance(m, now, wanted)
  for _, w in ipairs(wanted) do
    if not m.windows[w] then
      -- First use of this window by this user (a plan change): count what the log still
      -- holds, once. This one call costs O(events in the window); later calls do not.
      local b = now - w
      m.windows[w] = {total = sum_ranks(count_upto(b), redis.call('ZCARD', log_key) - 1), lo = b}
    end
  end
  local longest = 0
  for w, s in pairs(m.windows) do
    local b = now - w
    if s.lo < b then
      -- events in (lo, b] have left the window since the last call: subtract each once
      s.total = s.total - sum_ranks(count_upto(s.lo), count_upto(b) - 1)
      s.lo = b
    end
    if w > longest then longest = w end
  end
  -- Events older than the longest window are out of every total (each cursor is past them).
  local old = count_upto(now - longest)
  for start = 0, old - 1, BATCH do
    local ids = redis.call('ZRANGE', log_key, start, math.min(start + BATCH - 1, old - 1))
    redis.call('HDEL', ev_key, unpack(ids))
  end
  if old > 0 then redis.call('ZREMRANGEBYRANK', log_key, 0, old - 1) end
  return longest
end

-- Store the clock, totals and cursors; every key lives margin_ms past the longest window.
local function save_meta(m, now, longest)
  local fields = {'clk', int(now)}
  for w, s in pairs(m.windows) do
    fields[#fields + 1] = 't:' .. int(w)
    fields[#fields + 1] = int(s.total)
    fields[#fields + 1] = 'lo:' .. int(w)
    fields[#fields + 1] = int(s.lo)
  end
  redis.call('HSET', meta_key, unpack(fields))
  local ttl = int(longest + margin_ms)
  redis.call('PEXPIRE', log_key, ttl)
  redis.call('PEXPIRE', ev_key, ttl)
  redis.call('PEXPIRE', meta_key, ttl)
end

-- When the oldest event still inside the window leaves it (now when the window is empty).
local function resets_at(now, w)
  local first = redis.call('ZRANGEBYSCORE', log_key, '(' .. int(now - w), '+inf',
                           'WITHSCORES', 'LIMIT', 0, 1)
  if #first == 0 then return now end
  return tonumber(first[2]) + w
end
-- END shared ledger code ------------------------------------------------------------------

-- Longest walk over a window's oldest events when computing a wait. Each event costs at
-- least 1 token, so a walk needs at most `cost` events while the total is within the limit;
-- past this many (a lowered limit), the answer is the safe "when the window is empty".
local WALK = 16
local MAX_WALK = 1024

-- How long until enough of the oldest events leave window w to free `need` tokens, ms.
-- An event scored s leaves the window at s + w exactly (cursors take scores <= now - w).
local function wait_ms(now, w, need)
  local first = count_upto(now - w)
  local freed = 0
  for start = first, first + MAX_WALK - 1, WALK do
    local items = redis.call('ZRANGE', log_key, start, start + WALK - 1, 'WITHSCORES')
    if #items == 0 then break end
    local ids, scores = {}, {}
    for i = 1, #items, 2 do
      ids[#ids + 1] = items[i]
      scores[#scores + 1] = tonumber(items[i + 1])
    end
    local recs = redis.call('HMGET', ev_key, unpack(ids))
    for i = 1, #recs do
      freed = freed + record_cost(recs[i])
      if freed >= need then return scores[i] + w - now end
    end
  end
  local newest = redis.call('ZRANGE', log_key, -1, -1, 'WITHSCORES')
  if #newest == 0 then return w end
  return math.max(1, tonumber(newest[2]) + w - now)
end

local m = load_meta()
local now = math.max(now_arg, m.clk)
local longest = advance(m, now, call_windows)

local function reply(allowed, duplicate, retry, waits)
  local out = {allowed, duplicate, retry, now}
  for i, w in ipairs(call_windows) do
    out[#out + 1] = m.windows[w].total
    out[#out + 1] = resets_at(now, w)
    out[#out + 1] = waits[i] or 0
  end
  return out
end

if redis.call('ZSCORE', log_key, request_id) then
  save_meta(m, now, longest)
  local rec = redis.call('HGET', ev_key, request_id)
  local same_call = rec and string.match(rec, '^%d+ (%S+)') == nonce
  return reply(1, same_call and 0 or 1, 0, {})
end

local retry, waits = 0, {}
for i, w in ipairs(call_windows) do
  local total = m.windows[w].total
  if total + cost > limits[i] then
    waits[i] = wait_ms(now, w, total + cost - limits[i])
    retry = math.max(retry, waits[i])
  end
end
if retry > 0 then
  save_meta(m, now, longest)
  return reply(0, 0, retry, waits)
end

redis.call('ZADD', log_key, int(now), request_id)
redis.call('HSET', ev_key, request_id, int(cost) .. ' ' .. nonce .. ' ' .. route)
for _, s in pairs(m.windows) do s.total = s.total + cost end
save_meta(m, now, longest)
return reply(1, 0, 0, {})
