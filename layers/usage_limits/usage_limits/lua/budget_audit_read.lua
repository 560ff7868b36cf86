--[[ budget_audit_read.lua: what the conservation auditor compares of one user (read only).

One atomic read of the user's ledger and cached entitlements, so that the charges counted,
their draws and the copy's credit are one consistent picture (reading the keys one by one
could see a charge without its draw, or a draw without the credit it took).

KEYS[1]  log         zset: member = request id, score = time of the charge, ms
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>"
KEYS[3]  meta        hash: m (_budget_meta.lua)
KEYS[4]  ent         hash: epoch, want, plan, susp, g:<reference> (_budget_grants.lua)
KEYS[5]  dr          hash: request id -> "#<epoch> <ref>=<n> ..."
ARGV[1]  now_ms      the auditor's clock, ms since the epoch (integer)
ARGV[2]  max_events  most charges returned, newest first (integer >= 1): the bound of
                     this call's work

Counted: an event scored above both the longest window's cursor and (the later of now and
the key's clock) less that window; an event past it is out of every window even if no
call has retired it yet.

Returns {clk, longest_ms (0: no window, the ledger holds nothing), epoch (ent's load epoch,
0: not loaded, -1: no ent at all), {ref, value, ref, value, ...} (ent's grants), truncated
(1: more than max_events charges are counted), then per counted charge, newest first:
request_id, score, ev record or '', dr record or ''}.
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]
local ent_key = KEYS[4]
local dr_key = KEYS[5]
local now_ms = tonumber(ARGV[1])
local max_events = tonumber(ARGV[2])

--#include _budget_meta.lua  (meta's one-field layout)

local m = load_meta()
local longest = m.ws[#m.ws]
local epoch = -1
if redis.call('EXISTS', ent_key) == 1 then
  epoch = tonumber(redis.call('HGET', ent_key, 'epoch')) or 0
end
local grants = {}
if epoch >= 0 then
  local raw = redis.call('HGETALL', ent_key)
  for i = 1, #raw, 2 do
    local ref = string.match(raw[i], '^g:(.+)$')
    if ref then
      grants[#grants + 1] = ref
      grants[#grants + 1] = raw[i + 1]
    end
  end
end
local out = {string.format('%d', m.clk), string.format('%d', longest or 0),
             string.format('%d', epoch), grants, 0}
if not longest then return out end
local clock = math.max(now_ms, m.clk)
local floor = math.max(m.windows[longest].lo, clock - longest)
local ids = redis.call('ZREVRANGEBYSCORE', log_key, '+inf', '(' .. string.format('%d', floor),
                       'WITHSCORES', 'LIMIT', 0, max_events + 1)
for i = 1, #ids, 2 do
  if (i + 1) / 2 > max_events then
    out[5] = 1
    break
  end
  local rid = ids[i]
  out[#out + 1] = rid
  out[#out + 1] = ids[i + 1]
  out[#out + 1] = redis.call('HGET', ev_key, rid) or ''
  out[#out + 1] = redis.call('HGET', dr_key, rid) or ''
end
return out
