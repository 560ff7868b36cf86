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
KEYS[3]  meta        hash: clk (ms), t:<W> (tokens), lo:<W> (ms), f:<W> (ms or -1);
                     see budget_reserve.lua
ARGV[1]  request_id  the charge's id
ARGV[2]  new_cost    tokens the request really used (integer >= 0; 0 = refund it all)
ARGV[3]  nonce       the nonce of the reservation that made the charge (no spaces)

Returns 1 when the charge was lowered or removed, 0 when there was none to lower (unknown,
expired or already refunded id, another call's charge, or new_cost >= the recorded cost).
Run twice, the second run finds the charge gone or already at new_cost and returns 0.
Keys keep the expiry set by the last reservation: this script only removes or lowers data.
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]

local request_id = ARGV[1]
local new_cost = tonumber(ARGV[2])
local nonce = ARGV[3]

local score = redis.call('ZSCORE', log_key, request_id)
if not score then return 0 end
score = tonumber(score)

local rec = redis.call('HGET', ev_key, request_id)
-- another call's charge of the same id (or no record at all): not this caller's to lower
if not rec or string.match(rec, '^%d+ (%S+)') ~= nonce then return 0 end
local old_cost = tonumber(string.match(rec, '^%d+')) or 0
local rest = string.match(rec, '^%d+(.*)$') or ''
if new_cost >= old_cost and new_cost > 0 then return 0 end

local delta = old_cost - new_cost
local flat = redis.call('HGETALL', meta_key)
local unknown = {}
for i = 1, #flat, 2 do
  local kind, w = string.match(flat[i], '^(%a+):(%d+)$')
  -- still counted by this window: give the difference back
  if kind == 'lo' and delta > 0 and score > tonumber(flat[i + 1]) then
    redis.call('HINCRBY', meta_key, 't:' .. w, string.format('%d', -delta))
  end
  -- the window's oldest event leaves the log: the next call looks its successor up
  if kind == 'f' and new_cost == 0 and tonumber(flat[i + 1]) == score then
    unknown[#unknown + 1] = flat[i]
  end
end
if #unknown > 0 then redis.call('HDEL', meta_key, unpack(unknown)) end

if new_cost == 0 then
  redis.call('ZREM', log_key, request_id)
  redis.call('HDEL', ev_key, request_id)
else
  redis.call('HSET', ev_key, request_id, string.format('%d', new_cost) .. rest)
end
return 1
