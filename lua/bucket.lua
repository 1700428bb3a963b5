-- sluice bucket prelude: the state and the math every bucket script shares.
--
-- Not run on its own: src/limiter/redis.rs prepends this file to each of
-- acquire.lua, feedback.lua, release.lua and view.lua at compile time, so each script
-- is one self-contained EVALSHA (one round trip, one atomic decision).
--
-- Common contract of every script:
--   KEYS[1]  the endpoint's hash, "<prefix>{<endpoint>}". The {endpoint} hash tag keeps
--            all of one endpoint's state in one Redis Cluster slot; no key is ever built
--            in Lua (a key not in KEYS breaks on a cluster).
--   ARGV[1]  configured rate (tokens/s)   ARGV[2] burst (capacity)
--   ARGV[3]  recovery (µs; 0 = adaptive off)
--   ARGV[4..] script-specific, see each script.
--
-- This is a line-for-line port of src/limiter/bucket.rs (same formulas, same fields);
-- tests/store_behaviour.rs holds the memory and Redis stores to the same results.
--
-- Hash fields (all stored as strings, %.17g so doubles round-trip exactly):
--   tk tokens   ts time of tk (µs)   dr decreased rate (0 = none)   da climb start (µs)
--   du no decrease before (µs)   cu cooldown end (µs)   g generation   th throttles
--   fs at floor since (µs)   fl floor last given by feedback (for the key's TTL only)
--   cr tokens taken ahead by replicas (`store.prefetch`) and not yet expired
--   ce when those end (µs)
--   cs when Redis began counting the tokens held now (µs): names that hold, so a
--      give-back that arrives after it ended (and another began) lowers nothing but its own
--   ho starts (µs, space-separated) of reservations given up with others behind them,
--      for the next senders to take (bucket::BucketState::holes; at most 8)
--   la the latest start handed out (µs) while ahead (bucket::BucketState::last)
--   vu the latest start a cooldown voided (µs; bucket::BucketState::voided): the key
--      outlives it, so a voided reservation's confirmation never meets a key made afresh
--      at generation 0
--   wi until when (µs) the window logs below still count a start (the latest entry
--      plus its `per`): the key outlives it whichever script saves it last
--   n  writes so far (every save adds one): a key whose count is below one a replica
--      already heard went back in time (a failover to a replica the last writes had not
--      reached, a restart from an older snapshot); see acquire.lua's ARGV[9]
--   w<per>  one sliding window's log (`windows`, src/limiter/window.rs), per its `per`
--      in whole µs: "<start>:<cost> ..." oldest first, at most 32 entries
--
-- Windows: a script that decides or gives back a start names the endpoint's windows
-- ("<limit>:<per µs> ...", see win_spec) and the request's cost; the others leave the
-- logs alone.
--
-- Tokens taken ahead (Redis only; the memory store never takes any): acquire.lua may
-- hand a replica `cr` tokens to spend without asking, until `ce`. Until then the bucket
-- refills only up to burst - cr, so what is in the bucket plus what replicas hold never
-- exceeds the burst: sends in any window stay within rate x window + burst whether they
-- spend tokens asked for or tokens taken ahead.
--
-- Clock: Redis TIME only (never a replica's), in µs relative to a fixed epoch
-- (2023-11-14) so timestamps stay small and exact in a double. Writes after TIME need
-- effects replication, the default since Redis 5 (replicate_commands is a no-op there).

if redis.replicate_commands then
  redis.replicate_commands()
end

local key = KEYS[1]
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local recovery = tonumber(ARGV[3])

local EPOCH_S = 1700000000
local MICROS = 1000000
local t = redis.call('TIME')
local now = (tonumber(t[1]) - EPOCH_S) * MICROS + tonumber(t[2])

--- Exact text of a double (tostring keeps only 14 digits).
local function str(x)
  return string.format('%.17g', x)
end

local FIELDS = { 'tk', 'ts', 'dr', 'da', 'du', 'cu', 'g', 'th', 'fs', 'fl', 'cr', 'ce', 'cs',
                 'ho', 'la', 'vu', 'wi', 'n' }

-- The endpoint's windows, from the script's argument (win_spec): { limit, per, field }.
local WIN = {}
-- Most entries a window's log keeps exactly (window::MAX_ENTRIES).
local WIN_MAX = 32
-- window::SAME_START_US and window::EDGE_US.
local WIN_SAME = 1
local WIN_EDGE = 1

--- Reads the windows "<limit>:<per µs> ..." ("" = none) a script was given.
local function win_spec(spec)
  for l, p in string.gmatch(spec or '', '(%d+):(%d+)') do
    WIN[#WIN + 1] = { limit = tonumber(l), per = tonumber(p), field = 'w' .. p }
  end
end

--- The window logs of the key (after `load`): s.win[i] = { {at, cost}, ... }.
local function win_load(s)
  s.win = {}
  if #WIN == 0 then
    return
  end
  local names = {}
  for i = 1, #WIN do
    names[i] = WIN[i].field
  end
  local raw = redis.call('HMGET', key, unpack(names))
  for i = 1, #WIN do
    local log = {}
    if raw[i] then
      for a, c in string.gmatch(raw[i], '(%S+):(%S+)') do
        log[#log + 1] = { tonumber(a), tonumber(c) }
      end
    end
    s.win[i] = log
  end
end

--- The stored state, or nil when the key does not exist (a fresh full bucket).
--- `loaded` keeps the values as read, so `save` writes only what changed.
local loaded = nil
local function load()
  local raw = redis.call('HMGET', key, unpack(FIELDS))
  if not raw[1] then
    return nil
  end
  local tk, ts, dr, da, du = tonumber(raw[1]), tonumber(raw[2]), tonumber(raw[3]),
                             tonumber(raw[4]), tonumber(raw[5])
  local cu, g, th, fs, fl = tonumber(raw[6]), tonumber(raw[7]), tonumber(raw[8]),
                            tonumber(raw[9]), tonumber(raw[10] or '')
  local cr, ce, cs = tonumber(raw[11] or '0'), tonumber(raw[12] or '0'),
                     tonumber(raw[13] or '0')
  local ho = raw[14] or ''
  local la = tonumber(raw[15] or '0')
  local vu = tonumber(raw[16] or '0')
  local wi = tonumber(raw[17] or '0')
  local n = tonumber(raw[18] or '0')
  loaded = { tk = tk, ts = ts, dr = dr, da = da, du = du, cu = cu, g = g, th = th, fs = fs,
             fl = fl, cr = cr, ce = ce, cs = cs, ho = ho, la = la, vu = vu, wi = wi, n = n }
  local s = { tk = tk, ts = ts, dr = dr, da = da, du = du, cu = cu, g = g, th = th, fs = fs,
              fl = fl, cr = cr, ce = ce, cs = cs, ho = ho, la = la, vu = vu, wi = wi, n = n }
  win_load(s)
  return s
end

--- Empty logs, one per window.
local function win_empty()
  local w = {}
  for i = 1, #WIN do
    w[i] = {}
  end
  return w
end

--- bucket::fresh
local function fresh()
  return { tk = burst, ts = now, dr = 0, da = 0, du = 0, cu = 0, g = 0, th = 0, fs = 0,
           cr = 0, ce = 0, cs = 0, ho = '', la = 0, vu = 0, wi = 0, n = 0, win = win_empty() }
end

--- window::Log::prune: drops entries `per` or more behind now.
local function win_prune(log, per)
  local gone = 0
  while gone < #log and log[gone + 1][1] <= now - per do
    gone = gone + 1
  end
  if gone > 0 then
    local n = #log
    for i = 1, n - gone do
      log[i] = log[i + gone]
    end
    for i = n, n - gone + 1, -1 do
      log[i] = nil
    end
  end
end

--- window::Log::earliest: the first start >= from (and not before the latest entry) at
--- which (t - per, t] holds at most limit - cost.
local function win_earliest(log, limit, per, cost, from)
  if cost > limit then
    return math.huge
  end
  local t0 = from
  if #log > 0 and log[#log][1] > t0 then
    t0 = log[#log][1]
  end
  local excess = cost - limit
  for i = 1, #log do
    excess = excess + log[i][2]
  end
  if excess <= 0 then
    return t0
  end
  for i = 1, #log do
    excess = excess - log[i][2]
    if excess <= 0 then
      return math.max(t0, log[i][1] + per + WIN_EDGE)
    end
  end
  return t0
end

--- window::Log::record: appends a start, merging the closest two entries into the
--- later one's time when the log is full.
local function win_record(log, at, cost)
  log[#log + 1] = { at, cost }
  if #log > WIN_MAX then
    local best, gap = 2, math.huge
    for i = 2, #log do
      local g = log[i][1] - log[i - 1][1]
      if g < gap then
        gap = g
        best = i
      end
    end
    log[best][2] = log[best][2] + log[best - 1][2]
    table.remove(log, best - 1)
  end
end

--- window::Log::unrecord: takes cost off the entry at `at` (within a µs), if there.
local function win_unrecord(log, at, cost)
  for i = 1, #log do
    if math.abs(log[i][1] - at) <= WIN_SAME then
      log[i][2] = log[i][2] - math.min(cost, log[i][2])
      if log[i][2] <= 0 then
        table.remove(log, i)
      end
      return
    end
  end
end

--- window::Logs::earliest over every window of the script (pruning them first).
local function win_start(s, cost, from)
  local t = from
  for i = 1, #WIN do
    win_prune(s.win[i], WIN[i].per)
    t = math.max(t, win_earliest(s.win[i], WIN[i].limit, WIN[i].per, cost, from))
  end
  return t
end

--- Until when (µs) the logs still count a start (window::Logs::time_to_idle + now).
local function win_until(s)
  local u = 0
  for i = 1, #WIN do
    local log = s.win[i]
    if #log > 0 then
      u = math.max(u, log[#log][1] + WIN[i].per)
    end
  end
  return u
end

--- Tokens replicas hold ahead that may still be spent (0 once their time is over).
local function held_ahead(s)
  if s.ce > now then
    return s.cr
  end
  return 0
end

--- bucket::effective_rate
local function effective(s, at)
  if s.dr <= 0 or recovery <= 0 then
    return rate
  end
  local p = (at - s.da) / recovery
  if p < 0 then p = 0 elseif p > 1 then p = 1 end
  return math.min(s.dr + (rate - s.dr) * p, rate)
end

--- bucket::refill (trapezoid: the climb is concave, so this never exceeds the integral)
local function refill(s)
  if now <= s.ts then
    return
  end
  local r0, r1 = effective(s, s.ts), effective(s, now)
  s.tk = math.min(s.tk + (now - s.ts) / MICROS * (r0 + r1) / 2, burst - held_ahead(s))
  s.ts = now
  if s.dr > 0 and now - s.da >= recovery then
    s.dr = 0
    s.fs = 0
  end
end

--- The state brought to now (refilled), for a script a replica sends what it
--- heard of the bucket: `known`, how long (µs) it stays busy, and `seen`, the highest
--- write count. Lost (no key while `known` lasts) or gone back in time (a write count
--- below `seen`), it is rebuilt as a bucket full again only `known` from now at the
--- configured rate (the fastest it could refill), so the starts handed out before come
--- before any new one. Returns the state and whether it was rebuilt (then to be saved).
local function load_known(known, seen)
  local s = load()
  local lost = false
  if not s then
    s = fresh()
    lost = known > 0
  elseif known > 0 and s.n < seen then
    -- (Once `known` is over the bucket is full again: an older copy is no fuller.)
    lost = true
  end
  refill(s)
  if lost then
    s.tk = math.min(s.tk, burst - known / MICROS * rate)
    s.n = math.max(s.n, seen)
  end
  return s, lost
end

--- bucket::near_floor
local function near_floor(r, floor)
  return r <= floor + 0.1 * math.max(rate - floor, 0) + 1e-9
end

--- bucket::time_to_idle
local function time_to_idle(s, floor)
  local slowest = math.max(math.min(floor, rate), 1e-6)
  local refill_time = math.max(burst - s.tk, 0) / slowest * MICROS
  local until_ts = math.max(s.ts - now, 0)
  local rec = 0
  if s.dr > 0 then
    rec = math.max(s.da + recovery - now, 0)
  end
  local dec_window = math.max(s.du - now, 0)
  -- Never forget tokens held ahead while they may be spent: a fresh bucket is full.
  local ahead = math.max(s.ce - now, 0)
  -- Nor while a start it handed out is ahead, voided or not.
  local handed_out = math.max(math.max(s.la, s.vu) - now, 0)
  -- Nor while a window still counts a start (field wi, whichever script saves).
  local windows = math.max((s.wi or 0) - now, 0)
  return math.max(until_ts + refill_time, rec, dec_window, ahead, handed_out, windows)
end

--- bucket::acquire's reservation (after refill): takes `cost` tokens (and units of
--- every window) that start `wait` µs from now, or refuses, taking nothing, when that is
--- beyond `budget`. Returns granted (bool), the wait or the retry time (µs), and 1 when
--- a cooldown is why.
local function reserve(s, budget, cost)
  cost = cost or 1
  local plain = cost == 1 and #WIN == 0
  -- bucket::take_hole: a start a sender gave up comes first (the earliest still ahead).
  if s.tk < 1 and s.ho ~= '' and plain then
    local kept, best = {}, nil
    for w in string.gmatch(s.ho, '%S+') do
      local h = tonumber(w)
      if h > now then
        kept[#kept + 1] = h
        if not best or h < best then
          best = h
        end
      end
    end
    if best and best - now <= budget then
      local left, dropped = {}, false
      for i = 1, #kept do
        if kept[i] == best and not dropped then
          dropped = true
        else
          left[#left + 1] = str(kept[i])
        end
      end
      s.ho = table.concat(left, ' ')
      return true, best - now, 0
    end
    for i = 1, #kept do
      kept[i] = str(kept[i])
    end
    s.ho = table.concat(kept, ' ')
  end
  local base = math.max(s.ts, now)
  local r = effective(s, base)
  local missing = math.max(cost - s.tk, 0)
  local balance_start = base + missing / r * MICROS
  local start = balance_start
  -- Never among the starts already handed out (bucket::acquire).
  if s.la > now then
    start = math.max(start, s.la + cost * MICROS / r)
  end
  -- Every window must take the cost too (window::Logs::earliest).
  if #WIN > 0 then
    start = win_start(s, cost, start)
  end
  local wait = start - now
  if wait > budget then
    local cool_left = s.cu - now
    if cool_left > budget then
      return false, cool_left, 1
    end
    -- A cost no window can ever take waits forever: said as a very long time.
    return false, math.min(wait, 1e15), 0
  end
  if start > balance_start and not plain then
    -- Held back past where the balance has its tokens: they go at its own start
    -- (bucket::acquire), the bucket brought there and still until then.
    s.tk = math.min(s.tk + (start - base) / MICROS * r, burst - held_ahead(s))
    s.ts = start
  end
  s.tk = s.tk - cost
  if start > now and start > s.la then
    s.la = start
  end
  if #WIN > 0 then
    for i = 1, #WIN do
      win_record(s.win[i], start, cost)
    end
    s.wdirty = true
  end
  return true, math.max(wait, 0), 0
end

--- Writes the state and refreshes the expiry: the key vanishes on its own once idle
--- (full, no cooldown, no decrease), never while it still carries one, plus 1 s margin.
--- Only fields that differ from what `load` read are written (a saturated endpoint
--- changes `tk` and `ts` alone): formatting a double exactly costs about 1 µs each.
--- Every save adds one to the write count `n` (written as an integer, cheaply).
--- Returns the time to idle (µs) the expiry was set from.
local function save(s)
  s.n = s.n + 1
  local fields = { 'n', tostring(s.n) }
  if s.wdirty then
    -- The window logs this script changed, and until when they count.
    for i = 1, #WIN do
      local words = {}
      for j, e in ipairs(s.win[i]) do
        words[j] = str(e[1]) .. ':' .. e[2]
      end
      fields[#fields + 1] = WIN[i].field
      fields[#fields + 1] = table.concat(words, ' ')
    end
    s.wi = math.max(s.wi or 0, win_until(s))
  end
  for i = 1, #FIELDS - 1 do
    local f = FIELDS[i]
    local v = s[f]
    if v ~= nil and (loaded == nil or loaded[f] ~= v) and not (loaded == nil and v == '') then
      fields[#fields + 1] = f
      fields[#fields + 1] = type(v) == 'string' and v or str(v)
    end
  end
  redis.call('HSET', key, unpack(fields))
  local idle = time_to_idle(s, s.fl or rate)
  -- The key outlives what a replica hears (busy_for), tokens held ahead included.
  local held = held_ahead(s)
  local life = idle
  if held > 0 then
    life = math.max(idle, s.ce - now + held / rate * MICROS)
  end
  redis.call('PEXPIRE', key, math.ceil(life / 1000) + 1000)
  return idle
end

--- Sets the expiry of an endpoint's lease set (lease.lua, renew.lua) from its latest
--- lease's end, plus 1 s: never from the ttl of the call at hand.
local function expire_leases(leases)
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', leases, math.ceil((tonumber(last[2]) - now) / 1000) + 1000)
  end
end

--- What a replica is told of how long the bucket stays busy: until it is full again at
--- the configured rate, and at least a slot after its latest start; never past `idle`
--- (the time to idle, from which the key's expiry is set, counted at the floor rate
--- and through a recovery: a rebuild from that would refuse for minutes), so a key
--- missing while a replica's figure lasts was lost, not expired. With tokens held
--- ahead, at least until their hold ends and they would have refilled: until then a
--- replica may spend them, so a bucket rebuilt from this leaves them room (`save`
--- keeps the key that long too).
local function busy_for(s, idle)
  local full = math.max(s.ts - now, 0) + math.max(burst - s.tk, 0) / rate * MICROS
  local after_last = s.la - now + MICROS / rate
  local busy = math.min(idle, math.max(full, after_last, 0))
  local held = held_ahead(s)
  if held > 0 then
    busy = math.max(busy, s.ce - now + held / rate * MICROS)
  end
  return busy
end
