--[[ budget_charge.lua: one charge of a user, by its request id (read only).

What an operator's support refund needs to find the charge however old it is: its cost,
nonce and route, whether a window still counts it, and its draws from grants.

KEYS[1]  log         zset: member = request id, score = time of the charge, ms
KEYS[2]  ev          hash: request id -> "<cost> <nonce> <route>"
KEYS[3]  meta        hash: m (_budget_meta.lua)
KEYS[4]  dr          hash: request id -> "#<epoch> <ref>=<n> ..." (entitlements on; may be
                     absent)
ARGV[1]  request_id  the charge's id

Returns {} when there is no such charge, or when it has left every window (no charge any
more); else {score (ms), ev record, dr record or ''}.
]]
local log_key = KEYS[1]
local ev_key = KEYS[2]
local meta_key = KEYS[3]
local dr_key = KEYS[4]
local request_id = ARGV[1]

--#include _budget_meta.lua  (meta's one-field layout)

local score = redis.call('ZSCORE', log_key, request_id)
local rec = redis.call('HGET', ev_key, request_id)
if not score or not rec then return {} end
local m = load_meta()
local longest = m.ws[#m.ws]
if longest and tonumber(score) <= m.windows[longest].lo then return {} end
local draws = ''
if dr_key then draws = redis.call('HGET', dr_key, request_id) or '' end
return {score, rec, draws}
