-- acquire: refill, then reserve a token (or confirm a held one), or refuse.
-- Port of bucket::acquire. Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  budget: longest acceptable wait (µs)
-- ARGV[5]  held generation ("" = none): confirm that reservation instead of taking one
-- Returns  { granted 0|1, wait_us or retry_us (string), generation, cooldown 0|1 }
--          granted=1: start after wait_us; the reservation belongs to `generation`.
--          granted=0: nothing was consumed (nothing is written); retry after retry_us,
--          cooldown=1 when the refusal is due to a cooldown rather than the rate.
--
-- Why atomic: refill, the reservation and the balance going below zero must be one
-- read-modify-write; as GET/compare/SET from several replicas they would overdraw.

local budget = tonumber(ARGV[4])
local held = ARGV[5]
local s = load() or fresh()
refill(s)
if held ~= '' and tonumber(held) == s.g then
  -- The reservation survived (no cooldown voided it): go, taking nothing more.
  return { 1, '0', s.g, 0 }
end
local base = math.max(s.ts, now)
local r = effective(s, base)
local missing = math.max(1 - s.tk, 0)
local start = base + missing / r * MICROS
local wait = start - now
if wait > budget then
  local cool_left = s.cu - now
  if cool_left > budget then
    return { 0, str(cool_left), s.g, 1 }
  end
  return { 0, str(wait), s.g, 0 }
end
s.tk = s.tk - 1
save(s)
return { 1, str(math.max(wait, 0)), s.g, 0 }
