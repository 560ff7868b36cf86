--[[ budget_draw_rebase.lua: move one charge's draws onto the user's current copy.

A charge draws credit from the copy (ent) of some load epoch, and its draws are then
recorded in the record of truth on condition that the epoch is still that one. When a load
or an operator change took a new epoch in between, the record refuses the draw; the new
copy was read from the record of truth before the draw was recorded, so it does not count
it. This script takes the draw from the new copy as well, so that the draw can be recorded
under the new epoch: the request goes on instead of failing.

Only the very charge of the caller (its nonce is on the ev record) is moved. The copy must
hold every draw in full, in a grant that is still live: otherwise nothing changes (the
charge is refunded and its credit was never spent). A draw already under ent's epoch is
left as it is: run twice, the second run changes nothing and answers as the first.

KEYS[1]  ev          hash: request id -> "<cost> <nonce> <route>"
KEYS[2]  ent         hash: epoch, g:<reference>, ... (see _budget_grants.lua)
KEYS[3]  dr          hash: request id -> "#<epoch> <ref>=<n> ..." (the draws of each charge)
ARGV[1]  request_id  the charge's id
ARGV[2]  nonce       the nonce of the reservation that made it
ARGV[3]  now_ms      the caller's clock, ms: a grant expired at it cannot be drawn
ARGV[4]  reported    "<ref>=<flags> ...": the credit reports the charge made (l, x), kept on
                     the new copy's grants so that they are not made again

Returns {status, epoch}: status 1 moved (or already under ent's epoch), 0 ent not loaded
(load it, then call again), -1 no such charge of this caller, -2 the copy lacks the credit;
epoch: ent's epoch (0 = none).
]]
local ev_key = KEYS[1]
local ent_key = KEYS[2]
local dr_key = KEYS[3]

local request_id = ARGV[1]
local nonce = ARGV[2]
local now = tonumber(ARGV[3])
local reported = ARGV[4] or ''

local entitled = true
--#include _budget_grants.lua  (entitlements and draws)

local rec = redis.call('HGET', ev_key, request_id)
if not rec or string.match(rec, '^%d+ (%S+)') ~= nonce then return {-1, 0} end
local draw_epoch, list = G.more().parse_draws(redis.call('HGET', dr_key, request_id))
if #list == 0 then return {-1, 0} end
local ent = G.load_ent(ent_key)
if not ent.epoch then return {0, 0} end
if draw_epoch == ent.epoch then return {1, ent.epoch} end

local flags = {}
for ref, f in string.gmatch(reported, '(%S+)=(%a+)') do flags[ref] = f end
local grants = {}
for _, g in ipairs(G.more().grants_of(ent)) do grants[g.ref] = g end
for _, d in ipairs(list) do
  local g = grants[d[1]]
  if not g or not G.more().is_live(g, now) or g.remaining < d[2] then return {-2, ent.epoch} end
  g.remaining = g.remaining - d[2]
end
local fields = {}
for _, d in ipairs(list) do
  local g = grants[d[1]]
  for f in string.gmatch(flags[g.ref] or '', '%a') do
    if not string.find(g.flags, f, 1, true) then g.flags = g.flags .. f end
  end
  fields[#fields + 1] = 'g:' .. g.ref
  fields[#fields + 1] = G.more().grant_value(g)
end
redis.call('HSET', ent_key, unpack(fields))
redis.call('HSET', dr_key, request_id, G.more().encode_draws(ent.epoch, list))
return {1, ent.epoch}
