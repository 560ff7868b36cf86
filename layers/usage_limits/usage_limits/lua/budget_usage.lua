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
local call_windows = {}
for i = 4, #ARGV do call_windows[#call_windows + 1] = tonumber(ARGV[i]) end

--#include _budget_windows.lua  (the window bookkeeping shared with the other budget scripts)

if redis.call('EXISTS', log_key, meta_key) == 0 then
  local out = {now_arg}
  for _ = 1, #call_windows do
    out[#out + 1] = 0
    out[#out + 1] = -1
  end
  return out
end

local m = load_meta()
local now = math.max(now_arg, m.clk)
local longest = advance(m, now, call_windows)
save_meta(m, now, longest)

local out = {now}
for _, w in ipairs(call_windows) do
  out[#out + 1] = m.windows[w].total
  out[#out + 1] = resets_at(m, w)
end
if max_events > 0 then
  local items = redis.call('ZRANGE', log_key, 0, max_events - 1, 'REV', 'WITHSCORES')
  if #items > 0 then
    local ids = {}
    for i = 1, #items, 2 do ids[#ids + 1] = items[i] end
    local recs = redis.call('HMGET', ev_key, unpack(ids))
    for i = 1, #ids do
      out[#out + 1] = ids[i]
      out[#out + 1] = items[2 * i]
      out[#out + 1] = recs[i]
    end
  end
end
return out
