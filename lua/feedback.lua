-- feedback: apply an upstream pause (cooldown) and, when throttled, a rate decrease
-- once per cooldown window. Port of bucket::feedback. Runs after bucket.lua.
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  floor (tokens/s)   ARGV[5] decrease (multiplier in (0,1))
-- ARGV[6]  default cooldown (µs)   ARGV[7] pause (µs; 0 = none)   ARGV[8] throttled 0|1
-- ARGV[9]  pub/sub channel announcing cooldowns ("" = none)
-- Returns  1 (and, when a cooldown starts, PUBLISHes "KEYS[1] ARGV[7]" on
--          ARGV[9]..':until', so every replica knows until when it cools, then KEYS[1]
--          on ARGV[9], so waiting requests know their reservation must be confirmed)
--
-- Why atomic: "once per cooldown window" is decided here from the stored `du`, so fifty
-- concurrent 429s from any number of replicas lower the rate once; and the cooldown
-- empties the bucket and bumps the generation in the same step, so no acquire on any
-- replica can slip a grant in between.

local floor = tonumber(ARGV[4])
local decrease = tonumber(ARGV[5])
local default_cooldown = tonumber(ARGV[6])
local pause = tonumber(ARGV[7])
local throttled = ARGV[8] == '1'
local s = load() or fresh()
s.fl = floor
refill(s)
if throttled then
  s.th = s.th + 1
  if now >= s.du then
    local current = effective(s, now)
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
  -- Empty the bucket and move its clock to the cooldown's end: no grant before it ends,
  -- no burst after it, and outstanding reservations (older generation) are voided; the
  -- key outlives the latest of them (bucket::feedback).
  local base = math.max(s.ts, now)
  local latest = math.max(base + math.max(-s.tk, 0) / effective(s, base) * MICROS, s.la)
  s.vu = math.max(s.vu, latest)
  s.cu = now + pause
  s.tk = 0
  s.ts = s.cu
  s.g = s.g + 1
  s.ho = ''
  s.la = 0
  if ARGV[9] ~= '' then
    -- pcall: a Redis user allowed only the bare channel (an ACL written for it) still
    -- gets its cooldown saved and announced, without the end.
    redis.pcall('PUBLISH', ARGV[9] .. ':until', KEYS[1] .. ' ' .. ARGV[7])
    redis.call('PUBLISH', ARGV[9], KEYS[1])
  end
end
save(s)
return 1
