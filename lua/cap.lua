-- cap: lower the balance to at most a number of tokens now, what the bucket learns of
-- grants made elsewhere meanwhile (a replica's local fallback during an outage of this
-- store, or reservations it saw granted before Redis lost them). Port of bucket::cap.
-- Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  most tokens now (negative: reservations outstanding until -most/rate from now)
-- Returns  1
--
-- Why atomic: a read-modify-write of the balance that acquires on other replicas are
-- changing at the same moment. A missing key is a fresh full bucket, capped like any.

local most = tonumber(ARGV[4])
local s = load() or fresh()
refill(s)
local at_ts = most + math.max(s.ts - now, 0) / MICROS * effective(s, now)
if s.tk > at_ts then
  s.tk = at_ts
end
-- Starts given up here may have been spent elsewhere meanwhile.
s.ho = ''
save(s)
return 1
