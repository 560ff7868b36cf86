--[[ budget_reserve.lua: charge one request to a user's token budget if it fits every window.

The ledger keeps a running total per window instead of summing the window: each call moves
every window's cursor up to its new boundary and subtracts only the events that crossed it,
so each event is subtracted once per window and a call costs O(log N + expired events).
A call where no event leaves any window reads no range of the log.

KEYS[1]  log         zset: member = request id, score = time of the charge, ms since the epoch
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>" (cost in tokens)
KEYS[3]  meta        hash:  clk    latest clock seen, ms (the key's clock never runs back)
                            t:<W>  tokens counted in the window of W ms
                            lo:<W> cursor, ms: every event scored <= lo:<W> is out of t:<W>
                            f:<W>  score of the oldest event t:<W> counts, ms (-1: none);
                                   a cursor that stays below it passes no event, so most
                                   calls read no range; missing = unknown (looked up)
ARGV[1]  now_ms      caller's clock, ms since the epoch (integer)
ARGV[2]  request_id  the charge's id (printable, at most 256 characters)
ARGV[3]  cost        tokens to charge (integer >= 1)
ARGV[4]  nonce       random per call, no spaces: tells a client's re-send of this very call
                     (same nonce) from a second reservation of the same id (other nonce)
ARGV[5]  route       route recorded with the charge (audit trail), may be empty
ARGV[6]  margin_ms   keys live this long past the longest window, ms (integer >= 0)
ARGV[7]  plan        the windows, shortest first, as "<window_ms>:<limit>" items separated by
                     single spaces: window length in ms, limit in tokens (one argument, so
                     the client encodes and Redis parses one string per call, not two per window)
ARGV[8]  thresholds  optional: usage thresholds, "80,100/5" (percents of a window's limit /
                     margin in percentage points; _budget_thresholds.lua); absent = none

Run twice with the same arguments (redis-py re-sends a call whose reply was lost): the second
run finds the id charged with its own nonce and answers status 1 again, charging nothing.

Returns {status, retry_after_ms, binding, then per plan window: used, resets_at_ms}
  status          1 charged (now, or by this very call before a client re-sent it);
                  2 duplicate: the id was charged by another call, nothing charged now;
                  0 rejected: some window lacks room, nothing charged
  retry_after_ms  0 unless rejected; else ms until enough of the oldest events have left
                  every failing window (the longest of their waits)
  binding         when rejected, the position (1-based) of the window with that wait; else 0
  used            tokens in the window after this call
  resets_at_ms    when the oldest counted event leaves the window, ms; -1 when it is empty
then, when this call charged and crossed thresholds, per crossing: window position, percent
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
local plan = ARGV[7]
local call_windows, limits = {}, {}
local threshold_spec = ARGV[8] or ''
for w, limit in string.gmatch(plan, '(%d+):(%d+)') do
  call_windows[#call_windows + 1] = tonumber(w)
  limits[#limits + 1] = tonumber(limit)
end

--#include _budget_windows.lua  (the window bookkeeping shared with the other budget scripts)
--#include _budget_thresholds.lua  (usage-threshold crossings)

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
local function wait_ms(now, w, need)
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
    for i = 1, #recs do
      freed = freed + record_cost(recs[i])
      if freed >= need then return scores[i] + w - now end
    end
    walked = walked + #ids
    if #ids < size then break end
  end
  if walked >= MAX_WALK then
    -- the bound described above: the event that frees `need` if the rest cost 1 each
    local bound = redis.call('ZRANGE', log_key, start + walked + need - freed - 1,
                             start + walked + need - freed - 1, 'WITHSCORES')
    if #bound > 0 then return math.max(1, tonumber(bound[2]) + w - now) end
  end
  -- defensive only (cost <= limit, so the window's events always free enough unless
  -- records are missing): wait until the window is empty
  local newest = redis.call('ZRANGE', log_key, -1, -1, 'WITHSCORES')
  if #newest == 0 then return w end
  return math.max(1, tonumber(newest[2]) + w - now)
end

local m = load_meta()
local now = math.max(now_arg, m.clk)
local longest = advance(m, now, call_windows)

local function reply(status, retry, binding)
  local out = {status, retry, binding}
  for _, w in ipairs(call_windows) do
    out[#out + 1] = m.windows[w].total
    out[#out + 1] = resets_at(m, w)
  end
  return out
end

local fits = true
for i, w in ipairs(call_windows) do
  if m.windows[w].total + cost > limits[i] then fits = false end
end

if fits then
  -- NX: an id already in the log keeps its charge (a duplicate, answered below)
  if redis.call('ZADD', log_key, 'NX', int(now), request_id) == 1 then
    redis.call('HSET', ev_key, request_id, int(cost) .. ' ' .. nonce .. ' ' .. route)
    for _, s in pairs(m.windows) do
      s.total = s.total + cost
      if s.first == NONE then s.first = now end
    end
    save_meta(m, now, longest)
    return append_crossings(reply(1, 0, 0), threshold_spec, m, cost)
  end
elseif not redis.call('ZSCORE', log_key, request_id) then
  local retry, binding = 0, 0
  for i, w in ipairs(call_windows) do
    local total = m.windows[w].total
    if total + cost > limits[i] then
      local wait = wait_ms(now, w, total + cost - limits[i])
      if wait > retry then retry, binding = wait, i end
    end
  end
  save_meta(m, now, longest)
  return reply(0, retry, binding)
end

-- the id is already charged: by this very call (a client re-send) or by another one
save_meta(m, now, longest)
local rec = redis.call('HGET', ev_key, request_id)
local same_call = rec and string.match(rec, '^%d+ (%S+)') == nonce
return reply(same_call and 1 or 2, 0, 0)
