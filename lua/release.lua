-- release: give back a reservation whose sender went away (bounded by capacity).
-- Port of bucket::release. Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  generation of the reservation
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
s.tk = math.min(s.tk + 1, burst)
save(s)
return 1
