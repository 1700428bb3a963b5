-- sluice bucket script: every read-modify-write of one endpoint's bucket.
--
-- KEYS[1]  the endpoint's hash, "<prefix>{<endpoint>}" (the {endpoint} hash tag keeps
--          all of an endpoint's state in one Redis Cluster slot; no key is built here).
-- ARGV[1]  op: "acquire" | "release" | "feedback" | "view"
-- ARGV[2]  configured rate (tokens/s)     ARGV[3] burst (capacity)
-- ARGV[4]  recovery (µs; 0 = adaptive off)
-- acquire:  ARGV[5] budget (µs)   ARGV[6] held generation ("" = none)
--           -> {1, wait_us, generation} | {0, retry_us, cooldown 0|1}
-- release:  ARGV[5] generation                          -> 1 | 0
-- feedback: ARGV[5] floor  ARGV[6] decrease  ARGV[7] default cooldown (µs)
--           ARGV[8] pause (µs)  ARGV[9] throttled 0|1   -> 1
-- view:     ARGV[5] floor ("" = adaptive off)
--           -> false | {tokens, rate, cooldown_us, throttles, at_floor 0|1, floor_for_us}
-- Fractional values are returned as strings (Redis truncates Lua numbers to integers).
--
-- Why one script: refill, reservation, cooldown and decrease read and write the same
-- fields; split into GET/compare/SET round trips, replicas racing each other would
-- overdraw and compound decreases. Redis runs a script without interleaving commands,
-- so each decision is atomic, and the clock is Redis's TIME, never a replica's.
-- This is a line-for-line port of src/limiter/bucket.rs; the behaviour suite holds
-- the two to the same results.

local key = KEYS[1]
local op = ARGV[1]
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local recovery = tonumber(ARGV[4])

local t = redis.call('TIME')
-- Relative epoch keeps microsecond timestamps small and exact in a double.
local now = (tonumber(t[1]) - 1700000000) * 1000000 + tonumber(t[2])

local raw = redis.call('HMGET', key, 'tk', 'ts', 'dr', 'da', 'du', 'cu', 'g', 'th', 'fs')
local s
if raw[1] then
  s = { tk = tonumber(raw[1]), ts = tonumber(raw[2]), dr = tonumber(raw[3]), da = tonumber(raw[4]),
        du = tonumber(raw[5]), cu = tonumber(raw[6]), g = tonumber(raw[7]), th = tonumber(raw[8]),
        fs = tonumber(raw[9]) }
else
  if op == 'view' or op == 'release' then
    return false
  end
  s = { tk = burst, ts = now, dr = 0, da = 0, du = 0, cu = 0, g = 0, th = 0, fs = 0 }
end

local function effective(at)
  if s.dr <= 0 or recovery <= 0 then
    return rate
  end
  local p = (at - s.da) / recovery
  if p < 0 then p = 0 elseif p > 1 then p = 1 end
  return math.min(rate, s.dr + (rate - s.dr) * p)
end

-- Trapezoid refill: the climb is concave, so this never exceeds the true integral.
local function refill()
  if now <= s.ts then
    return
  end
  local r0, r1 = effective(s.ts), effective(now)
  s.tk = math.min(burst, s.tk + (now - s.ts) / 1000000 * (r0 + r1) / 2)
  s.ts = now
  if s.dr > 0 and now - s.da >= recovery then
    s.dr = 0
    s.fs = 0
  end
end

local function near_floor(r, floor)
  return r <= floor + 0.1 * math.max(0, rate - floor) + 1e-9
end

local function save()
  redis.call('HSET', key, 'tk', tostring(s.tk), 'ts', tostring(s.ts), 'dr', tostring(s.dr),
    'da', tostring(s.da), 'du', tostring(s.du), 'cu', tostring(s.cu), 'g', s.g, 'th', s.th,
    'fs', tostring(s.fs))
  -- Expire only once the bucket is idle again: full, no cooldown, no decrease to remember.
  local slowest = rate
  if s.dr > 0 then slowest = math.min(rate, s.dr) end
  local idle = math.max(0, s.ts - now) + math.max(0, burst - s.tk) / slowest * 1000000
  if s.dr > 0 then idle = math.max(idle, s.da + recovery - now) end
  idle = math.max(idle, s.du - now)
  redis.call('PEXPIRE', key, math.ceil(idle / 1000) + 1000)
end

if op == 'acquire' then
  local budget = tonumber(ARGV[5])
  local held = ARGV[6]
  refill()
  if held ~= '' and tonumber(held) == s.g then
    return { 1, '0', s.g }
  end
  local base = math.max(s.ts, now)
  local r = effective(base)
  local missing = math.max(0, 1 - s.tk)
  local wait = base + missing / r * 1000000 - now
  if wait > budget then
    local cool = s.cu - now
    if cool > budget then
      return { 0, tostring(cool), 1 }
    end
    return { 0, tostring(wait), 0 }
  end
  s.tk = s.tk - 1
  save()
  return { 1, tostring(math.max(0, wait)), s.g }
elseif op == 'release' then
  if tonumber(ARGV[5]) ~= s.g then
    return 0
  end
  refill()
  s.tk = math.min(burst, s.tk + 1)
  save()
  return 1
elseif op == 'feedback' then
  local floor = tonumber(ARGV[5])
  local decrease = tonumber(ARGV[6])
  local default_cooldown = tonumber(ARGV[7])
  local pause = tonumber(ARGV[8])
  local throttled = ARGV[9] == '1'
  refill()
  if throttled then
    s.th = s.th + 1
    -- Once per cooldown window, decided from stored state: concurrent 429s from any
    -- number of replicas lower the rate once.
    if now >= s.du then
      local current = effective(now)
      local lowered = math.max(current * decrease, math.min(floor, rate))
      local was_at_floor = s.dr > 0 and near_floor(current, floor)
      s.dr = lowered
      s.da = now + pause
      s.du = now + math.max(pause, default_cooldown)
      if near_floor(lowered, floor) and not was_at_floor then
        s.fs = now
      end
    end
  end
  if pause > 0 and now + pause > s.cu then
    -- Empty the bucket and move its clock to the cooldown's end: no grant before it
    -- ends, no burst after it, and outstanding reservations are voided.
    s.cu = now + pause
    s.tk = 0
    s.ts = s.cu
    s.g = s.g + 1
  end
  save()
  return 1
elseif op == 'view' then
  refill()
  local r = effective(now)
  local at_floor, floor_for = 0, 0
  if ARGV[5] ~= '' and s.dr > 0 and near_floor(r, tonumber(ARGV[5])) then
    at_floor = 1
    if s.fs > 0 then floor_for = now - s.fs end
  end
  return { tostring(s.tk), tostring(r), tostring(math.max(0, s.cu - now)), s.th, at_floor, tostring(floor_for) }
end
return redis.error_reply('sluice bucket script: unknown op ' .. tostring(op))
