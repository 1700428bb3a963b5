-- acquire: refill, then for each ask in order reserve a token (or confirm a held one),
-- or refuse it. Port of bucket::acquire, applied to each ask in turn at one instant:
-- a batch of asks decides exactly as that many back-to-back calls would.
-- Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- KEYS[2]  (`store.prefetch = "alone"`, only with tokens wanted ahead) the replicas'
--          heartbeat set, "<prefix>{_replicas}:heartbeats" (see replicas.lua)
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  tokens wanted ahead (`store.prefetch`; 0 = none), ARGV[5] how long they count
--          as held unless given back sooner (µs; longer than the replica spends them)
-- ARGV[6]  with KEYS[2]: this replica's id there; tokens go ahead only while it is the
--          one live replica. ARGV[7] a heartbeat's time to live (ms). Else "" and 0.
-- ARGV[8]  how long (µs from now) this replica knows the bucket stays busy (not yet
--          full again): the <busy> of its last answer here, counted from when that answer
--          came; 0 when it knows of none. The key outlives that by its 1 s margin
--          (bucket.lua's `save`), so a key missing before then is a store that lost its
--          state (restarted empty, failed over before the last writes reached the
--          replica, evicted), not a bucket that went idle: it is rebuilt as busy for that
--          long (see `lost` below), not as a fresh full bucket (a second burst on top of
--          the reservations already handed out).
-- ARGV[9]  the highest write count (`n`, see bucket.lua) this replica heard for the key;
--          0 when none. A key whose count is lower went back in time (a failover to a
--          replica the last writes had not reached, a restart from an older snapshot, or
--          a key made afresh by another script after the loss): it is rebuilt the same
--          way, its balance lowered to what ARGV[8] allows.
-- ARGV[10] the endpoint's windows, "<limit>:<per µs> ..." ("" = none; bucket.lua's
--          win_spec)
-- ARGV[11] the asks' costs (tokens and window units each spends), "<cost> ..." in the
--          asks' order ("" = every ask costs 1)
-- ARGV[12], ARGV[13]  the first ask: budget, the longest acceptable wait (µs), and its
--          held generation ("" = none: take a token; else confirm that reservation)
-- ARGV[14], ARGV[15]  the second ask, and so on (src/limiter/batch.rs sends one pair per
--          request that queued while the previous call for this endpoint was in flight).
--          No ask at all: a top-up, asking only for tokens ahead (ARGV[4]). Tokens go
--          ahead only to an endpoint without windows, and only when every ask costs 1.
-- Returns  one string (one bulk reply: cheap for the client to read, and cheap to build
--          here, where turning a number into text is the costly part):
--            "<generation> <ahead> <hold> <busy> <n> <now> <rebuilt> <ask 1> <ask 2> ..."
--          each ask one word: "G" granted now, "G<µs>" granted to start after <µs>, "R<µs>"
--          refused by the rate, retry after <µs>, "C<µs>" refused because of a cooldown
--          (whole µs, rounded up: never early). A granted reservation belongs to
--          <generation>; a refused ask consumed nothing.
--          <ahead>: the tokens taken ahead (0 or more), which the replica may spend
--          without asking for a while (src/limiter/credit.rs), then gives back the
--          unspent ones (release.lua) before ARGV[5] µs are over. Only when every ask
--          went at once, no cooldown or decrease is in force, and the bucket keeps at
--          least half its burst: a busy endpoint far from its limit, never one that binds;
--          with KEYS[2], only while no other replica is alive to want them.
--          <hold>: with tokens ahead, the hold they joined (`cs`, see bucket.lua), which
--          their give-back names; else 0.
--          <busy>: µs until the bucket is full again at the configured rate and a slot
--          past its latest start, at most its time to idle (bucket.lua's `busy_for`;
--          whole µs rounded down, from 1e14 on in exponent form), 0 when no key is left:
--          what the replica sends back as ARGV[8]. <n>: the key's write count (ARGV[9]).
--          <now>: this call's instant on the store's clock (µs): a granted ask starts at
--          <now> plus its wait, which is what a give-back names (release.lua's ARGV[8]),
--          however long this call and the give-back each took to arrive.
--          <rebuilt>: 1 when this call found the key lost or gone back in time and
--          rebuilt it (ARGV[8], ARGV[9]), else 0: the replica counts and logs it.
--
-- Why atomic: refill, the reservation and the balance going below zero must be one
-- read-modify-write; as GET/compare/SET from several replicas they would overdraw.

win_spec(ARGV[10])
local costs = {}
for c in string.gmatch(ARGV[11] or '', '%S+') do
  costs[#costs + 1] = tonumber(c)
end
local s, lost = load_known(tonumber(ARGV[8]), tonumber(ARGV[9]))
local taken = false
local all_now = true
local asks = (#ARGV - 11) / 2
local answers
-- A busy endpoint far from its limit: a token for every ask, none to wait for (no
-- reservation or cooldown pushed the bucket's time ahead, no window to count). Each ask
-- is then granted now, exactly as the loop below would decide it, without its per-ask
-- arithmetic: a batch costs about what one ask does.
local quick = s.ts <= now and s.tk >= asks and s.la <= now and #WIN == 0 and #costs == 0
if quick then
  local spent = 0
  for i = 12, #ARGV - 1, 2 do
    if tonumber(ARGV[i]) < 0 then
      quick = false
      break
    end
    local held = ARGV[i + 1]
    if held == '' or tonumber(held) ~= s.g then
      spent = spent + 1
    end
  end
  if quick then
    s.tk = s.tk - spent
    taken = spent > 0
    answers = asks > 0 and (string.rep('G ', asks - 1) .. 'G') or ''
  end
end
if not quick then
  local out = {}
  for i = 12, #ARGV - 1, 2 do
    local held = ARGV[i + 1]
    if held ~= '' and tonumber(held) == s.g then
      -- The reservation survived (no cooldown voided it): go, taking nothing more.
      out[#out + 1] = 'G'
    else
      local cost = costs[(i - 10) / 2] or 1
      all_now = all_now and cost == 1
      local granted, us, cooldown = reserve(s, tonumber(ARGV[i]), cost)
      taken = taken or granted
      all_now = all_now and granted and us <= 0
      local w = math.ceil(us)
      if granted then
        out[#out + 1] = w > 0 and ('G' .. w) or 'G'
      elseif cooldown == 1 then
        out[#out + 1] = 'C' .. w
      else
        out[#out + 1] = 'R' .. w
      end
    end
  end
  answers = table.concat(out, ' ')
end
--- Whether this replica (ARGV[6]) is the only live one in the heartbeat set KEYS[2]
--- (live: heard within the time to live, as replicas.lua counts them).
local function alone()
  if not KEYS[2] then
    return true
  end
  local since = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[7])
  local mine = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[6]))
  return mine ~= nil and mine > since
    and redis.call('ZCOUNT', KEYS[2], '(' .. since, '+inf') == 1
end

local ahead = 0
local wanted = tonumber(ARGV[4])
if wanted > 0 and all_now and #WIN == 0 and s.cu <= now and s.dr <= 0 and alone() then
  ahead = math.min(wanted, math.floor(s.tk - burst / 2))
  if ahead > 0 then
    local held = held_ahead(s)
    if held == 0 then
      -- A new hold: a give-back for an earlier one must not lower this one's count.
      s.cs = now
    end
    s.tk = s.tk - ahead
    s.cr = held + ahead
    s.ce = math.max(s.ce, now + tonumber(ARGV[5]))
    taken = true
  else
    ahead = 0
  end
end
local busy = 0
if taken or lost then
  busy = busy_for(s, save(s))
elseif loaded then
  busy = busy_for(s, time_to_idle(s, s.fl or rate))
end
busy = math.floor(busy)
local hold = ahead > 0 and str(s.cs) or '0'
return s.g .. ' ' .. ahead .. ' ' .. hold .. ' ' .. tostring(busy) .. ' ' .. tostring(s.n)
  .. ' ' .. str(now) .. (lost and ' 1 ' or ' 0 ') .. answers
