-- release: give back a reservation whose sender went away (bounded by capacity).
-- Port of bucket::release. Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  generation of the reservation
-- ARGV[5]  tokens given back (absent: 1)
-- ARGV[6]  when they were taken ahead (`store.prefetch`) and not spent: the hold they
--          were taken in (acquire.lua's <hold>). While that hold lasts they no longer count
--          as held ahead; once it is over they already do not, and the count belongs to
--          whatever hold came after (other tokens, still spendable): it is left alone.
-- Returns  1 when refunded; 0 when a cooldown voided it (other generation) or the key
--          is gone (an expired key is a fresh full bucket: nothing to give back).
--
-- Why atomic: the refund is a read-modify-write of the balance that acquires on other
-- replicas are changing at the same moment.

local s = load()
if not s or tonumber(ARGV[4]) ~= s.g then
  return 0
end
refill(s)
local n = tonumber(ARGV[5] or '1')
local hold = tonumber(ARGV[6] or '')
if hold and hold == s.cs and s.ce > now then
  s.cr = math.max(s.cr - n, 0)
end
s.tk = math.min(s.tk + n, burst - held_ahead(s))
save(s)
return 1
