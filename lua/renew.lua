-- renew: extend a live in-flight lease by its ttl. Port of lease::renew.
-- Runs after bucket.lua (prepended at compile time) for its clock; the bucket is untouched.
--
-- KEYS[1]  "<prefix>{<endpoint>}"   KEYS[2] "<prefix>{<endpoint>}:leases"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)   (unused here)
-- ARGV[4]  lease ttl (µs)   ARGV[5] lease member (replica:id)
-- Returns  1 when renewed; 0 when the lease had expired (or was released).
--
-- Why a script: the new expiry is computed on Redis's clock (TIME), never a replica's,
-- and only an existing lease is extended, in one round trip.

local leases = KEYS[2]
local ttl = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', leases, '-inf', str(now))
if not redis.call('ZSCORE', leases, ARGV[5]) then
  return 0
end
redis.call('ZADD', leases, 'XX', str(now + ttl), ARGV[5])
redis.call('PEXPIRE', leases, math.ceil(ttl / 1000) + 1000)
return 1
