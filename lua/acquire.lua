-- acquire: refill, then for each ask in order reserve a token (or confirm a held one),
-- or refuse it. Port of bucket::acquire, applied to each ask in turn at one instant:
-- a batch of asks decides exactly as that many back-to-back calls would.
-- Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  tokens wanted ahead (`store.prefetch`; 0 = none), ARGV[5] for how long (µs)
-- ARGV[6], ARGV[7]  the first ask: budget, the longest acceptable wait (µs), and its
--          held generation ("" = none: take a token; else confirm that reservation)
-- ARGV[8], ARGV[9]  the second ask, and so on (src/limiter/batch.rs sends one pair per
--          request that queued while the previous call for this endpoint was in flight)
-- Returns  one string of space-separated whole numbers (one bulk reply: far cheaper for
--          a client to parse than an array of integers), four per ask, in order:
--          granted 0|1, wait_us or retry_us (whole µs, rounded up: never early),
--          generation, cooldown 0|1
--          granted=1: start after wait_us; the reservation belongs to `generation`.
--          granted=0: nothing was consumed for it; retry after retry_us, cooldown=1
--          when the refusal is due to a cooldown rather than the rate.
--          Then one more entry: the tokens taken ahead (0 or more), which the replica may
--          spend without asking until ARGV[5] µs after it sent this call. Only when every
--          ask went at once, no cooldown or decrease is in force, and the bucket keeps at
--          least half its burst: a busy endpoint far from its limit, never one that binds.
--
-- Why atomic: refill, the reservation and the balance going below zero must be one
-- read-modify-write; as GET/compare/SET from several replicas they would overdraw.

local s = load() or fresh()
refill(s)
local out = {}
local taken = false
local all_now = true
for i = 6, #ARGV - 1, 2 do
  local held = ARGV[i + 1]
  local n = #out
  if held ~= '' and tonumber(held) == s.g then
    -- The reservation survived (no cooldown voided it): go, taking nothing more.
    out[n + 1], out[n + 2], out[n + 3], out[n + 4] = 1, 0, s.g, 0
  else
    local granted, us, cooldown = reserve(s, tonumber(ARGV[i]))
    taken = taken or granted
    all_now = all_now and granted and us <= 0
    out[n + 1], out[n + 2], out[n + 3], out[n + 4] = granted and 1 or 0, math.ceil(us), s.g, cooldown
  end
end
local ahead = 0
local wanted = tonumber(ARGV[4])
if wanted > 0 and all_now and s.cu <= now and s.dr <= 0 then
  ahead = math.min(wanted, math.floor(s.tk - burst / 2))
  if ahead > 0 then
    s.tk = s.tk - ahead
    s.cr = held_ahead(s) + ahead
    s.ce = math.max(s.ce, now + tonumber(ARGV[5]))
    taken = true
  else
    ahead = 0
  end
end
out[#out + 1] = ahead
if taken then
  save(s)
end
return table.concat(out, ' ')
