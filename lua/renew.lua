-- renew: extend a live in-flight lease by its ttl, or adopt one. Port of lease::renew
-- and lease::adopt. Runs after bucket.lua (prepended at compile time) for its clock; the
-- bucket is untouched.
--
-- KEYS[1]  "<prefix>{<endpoint>}"   KEYS[2] "<prefix>{<endpoint>}:leases"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)   (unused here)
-- ARGV[4]  lease ttl (µs)   ARGV[5] lease member (replica:id)
-- ARGV[6]  1: adopt (add the lease when absent, whatever the slots held: its request
--          is in flight, granted while another store decided); 0: renew only
-- Returns  1 when renewed (or adopted); 0 when the lease had expired (or was released).
--
-- Why a script: the new expiry is computed on Redis's clock (TIME), never a replica's,
-- and, renewing, only an existing lease is extended (a renewal racing the release must
-- not bring a lease back), in one round trip.

local leases = KEYS[2]
local ttl = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', leases, '-inf', str(now))
if ARGV[6] ~= '1' and not redis.call('ZSCORE', leases, ARGV[5]) then
  return 0
end
redis.call('ZADD', leases, str(now + ttl), ARGV[5])
-- The set lives as long as its longest lease, whatever this call's ttl (a replica with a
-- shorter `lease_ttl`, or one after a reload, used to cut every other lease short).
expire_leases(leases)
return 1
