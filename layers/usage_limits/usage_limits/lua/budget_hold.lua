--[[ budget_hold.lua: confirm a provisional charge, and claim the user's expired ones.

A reservation made with hold_ms (budget_reserve.lua) is provisional: its request confirms
it when it succeeds, before the answer goes out. One never confirmed (the request failed and
its refund was lost, the reservation's reply was lost, the execution environment died)
may be undone from its pv time on by any request of the same user: this script claims it
(pv score -1, so its own request can no longer confirm it) and tells the caller which
charge to refund; the caller refunds it with its nonce (through the record of truth first
when it drew credit). A claimed entry is told again to every later call until its charge
is gone, so a claimer that died or failed leaves it to the next one. Confirming and
claiming exclude each other: a charge is either confirmed (its success stands) or claimed
(it is undone and its request answers that it failed), never both.

KEYS[1]  ev          hash: request id -> "<cost> <nonce> <route>"
KEYS[2]  pv          zset: request id -> when its provisional charge may be undone, ms
                     (-1: claimed, being undone)
KEYS[3]  dr          optional (entitlements on): hash: request id -> draws of the charge
ARGV[1]  now_ms      caller's clock, ms since the epoch
ARGV[2]  request_id  the charge to confirm ('' = none: only claim)
ARGV[3]  nonce       the nonce of the reservation that made it
ARGV[4]  limit       claim at most this many expired charges (>= 0)

Returns {confirmed, then per claimed charge: request id, nonce, cost, drew}:
  confirmed  1 the charge is confirmed (now, or it was not provisional); 0 it is gone or
             claimed (its request must answer that it failed); -1 no id given
  drew       1 when the charge drew credit (its dr record exists), else 0

Run twice (a re-send after a lost reply): a confirmed charge is answered 1 again (its pv
entry is gone, its record still has the nonce), a claim claims nothing new, and the
claimed charges are told again: refunding them twice is safe (by nonce).
]]
local ev_key, pv_key, dr_key = KEYS[1], KEYS[2], KEYS[3]
local now = tonumber(ARGV[1])
local request_id = ARGV[2]
local nonce = ARGV[3]
local limit = tonumber(ARGV[4])

local function nonce_of(rec)
  return rec and string.match(rec, '^%d+ (%S+)')
end

local out = {-1}
if request_id ~= '' then
  out[1] = 0
  if nonce_of(redis.call('HGET', ev_key, request_id)) == nonce then
    local at = redis.call('ZSCORE', pv_key, request_id)
    if not at or tonumber(at) >= 0 then
      redis.call('ZREM', pv_key, request_id)
      out[1] = 1
    end
  end
end

if limit > 0 then
  local due = redis.call('ZRANGEBYSCORE', pv_key, '-inf', now, 'LIMIT', 0, limit)
  for _, rid in ipairs(due) do
    local rec = redis.call('HGET', ev_key, rid)
    if not rec then
      redis.call('ZREM', pv_key, rid)  -- refunded or gone: nothing to undo
    else
      redis.call('ZADD', pv_key, 'XX', -1, rid)
      out[#out + 1] = rid
      out[#out + 1] = nonce_of(rec) or ''
      out[#out + 1] = tonumber(string.match(rec, '^%d+')) or 0
      out[#out + 1] = (dr_key and redis.call('HEXISTS', dr_key, rid) == 1) and 1 or 0
    end
  end
end
return out
