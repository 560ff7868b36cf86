--[[ _budget_grants.lua: reading and writing a user's entitlements (ent) and draws (dr), for
budget_reserve.lua, budget_refund.lua and budget_usage.lua. Not a script of its own: LuaScript
pastes it where a script says `--#include _budget_grants.lua`.

ent (hash): epoch (load epoch; its presence means "loaded"), want (only on an invalidated ent:
the least epoch the next load must have), plan (an operator's plan override), susp (suspension
end, ms; 0 = until lifted), ng (the number of grants the load wrote; absent in a copy loaded
before it existed), and per live grant g:<reference> =
"<remaining> <expires_ms or 0> <kind> <created_ms> <tokens>[ <flags>]", kind promo|paid, flags
a subset of "l" (low credit reported) and "x" (exhausted reported).
dr (hash): request id -> "#<epoch> <ref>=<n> <ref>=<n>", the draws of that charge in draw
order and the ent epoch they were drawn under. A reference never holds a space or '#'.

Everything is defined in the table G, and only when the including script has set
`entitled` (entitlements on): creating closures costs Redis time on every call, so a call
with entitlements off pays for none of this, and one that only reads ent (no draw, no
refund) makes only G.load_ent and G.more.
]]
local G = nil
if entitled then
  G = {}

  -- ent as {key, epoch = n or nil, want = n or nil, plan = name or nil, susp = ms or nil};
  -- G.more().grants_of(e) reads and parses the grants on first use only (one HMGET of the
  -- fixed fields costs less than reading every grant): a call that draws nothing, and
  -- rejects nothing, never reads them.
  function G.load_ent(key)
    local v = redis.call('HMGET', key, 'epoch', 'want', 'plan', 'susp')
    return {key = key, epoch = tonumber(v[1]), want = tonumber(v[2]), plan = v[3] or nil,
            susp = tonumber(v[4])}
  end

  -- The rest is made on first need (G.more()): a call that only reads ent makes none of it.
  function G.more()
    if G.live_grants then return G end

    -- The grants of ent, each {ref, remaining, expires (0 = never), kind, created, tokens,
    -- flags}, parsed once.
    function G.grants_of(e)
      if e.grants then return e.grants end
      e.grants = {}
      local raw = redis.call('HGETALL', e.key)
      for i = 1, #raw, 2 do
        local ref = string.match(raw[i], '^g:(.+)$')
        local rem, exp, kind, created, tokens, flags = string.match(
          raw[i + 1], '^(%d+) (%d+) (%a+) (%d+) (%d+) ?(%a*)$')
        if ref and rem then
          e.grants[#e.grants + 1] = {ref = ref, remaining = tonumber(rem),
                                     expires = tonumber(exp), kind = kind,
                                     created = tonumber(created), tokens = tonumber(tokens),
                                     flags = flags}
        end
      end
      return e.grants
    end

    -- The ent field value of a grant.
    function G.grant_value(g)
      local v = string.format('%d %d %s %d %d', g.remaining, g.expires, g.kind, g.created, g.tokens)
      if g.flags ~= '' then v = v .. ' ' .. g.flags end
      return v
    end

    -- A grant covers requests at `now` unless it has expired (now >= its expiry).
    function G.is_live(g, now)
      return g.expires == 0 or now < g.expires
    end

    -- Draw order: earliest expiry first (no expiry last), promo before paid, older first, then
    -- by reference.
    function G.draws_before(a, b)
      local ea = a.expires == 0 and math.huge or a.expires
      local eb = b.expires == 0 and math.huge or b.expires
      if ea ~= eb then return ea < eb end
      if a.kind ~= b.kind then return a.kind == 'promo' end
      if a.created ~= b.created then return a.created < b.created end
      return a.ref < b.ref
    end

    -- The live grants of ent at `now`, in draw order, and their credit (sum of remaining).
    function G.live_grants(e, now)
      local live, credit = {}, 0
      for _, g in ipairs(G.grants_of(e)) do
        if G.is_live(g, now) then
          live[#live + 1] = g
          credit = credit + g.remaining
        end
      end
      table.sort(live, G.draws_before)
      return live, credit
    end

    -- A dr record as (epoch, list of {ref, n}); (nil, {}) for none.
    function G.parse_draws(rec)
      if not rec then return nil, {} end
      local epoch = tonumber(string.match(rec, '^#(%d+)'))
      local list = {}
      for ref, n in string.gmatch(rec, ' (%S+)=(%d+)') do list[#list + 1] = {ref, tonumber(n)} end
      return epoch, list
    end

    -- The dr record of draws made under `epoch`.
    function G.encode_draws(epoch, list)
      local parts = {string.format('#%d', epoch)}
      for _, d in ipairs(list) do parts[#parts + 1] = d[1] .. '=' .. string.format('%d', d[2]) end
      return table.concat(parts, ' ')
    end

    return G
  end

end
