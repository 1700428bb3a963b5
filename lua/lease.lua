-- lease: take an in-flight slot (a lease) and a token together, or nothing.
-- Port of lease::acquire. Runs after bucket.lua (prepended at compile time). Used only
-- for endpoints with max_in_flight; acquire.lua stays the path (and the cost) of the rest.
--
-- KEYS[1]  "<prefix>{<endpoint>}"          the bucket hash
-- KEYS[2]  "<prefix>{<endpoint>}:leases"   sorted set: lease member -> expiry (µs)
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  budget: longest acceptable wait for the token (µs)
-- ARGV[5]  max_in_flight   ARGV[6] lease ttl (µs)   ARGV[7] lease member (replica:id)
-- ARGV[8], ARGV[9]  how long this replica knows the bucket stays busy (µs) and the
--          highest write count it heard: a lost key, or one gone back in time, is
--          rebuilt as acquire.lua does (see its ARGV[8] and ARGV[9]).
-- ARGV[10] the endpoint's windows (acquire.lua's ARGV[10])   ARGV[11] the cost
-- Returns  { code, wait_us or retry_us (string), generation, cooldown 0|1, busy, n, at,
--            rebuilt }
--          code=1: token reserved (start after wait_us) and the slot leased until
--                  now + ttl; code=0: refused as acquire.lua refuses, nothing taken;
--          code=2: every slot is leased, nothing taken; retry_us = until the soonest
--                  lease expires (a release may come sooner).
--          busy, n: acquire.lua's <busy> (a string) and <n>; busy "-1" when the bucket
--          was not read (code 2) or no key is left. at (a string): with code=1, the
--          reservation's start on the store's clock (µs), which a give-back names
--          (release.lua's ARGV[8]); else "0". rebuilt: 1 when the key was found lost or
--          gone back in time and rebuilt (acquire.lua's <rebuilt>), else 0.
--
-- Why atomic: counting live leases, taking the token and adding the lease must be one
-- step, or two replicas could both see the last free slot. Expired leases (of a replica
-- that died without releasing) are pruned here, on the store's clock.

local leases = KEYS[2]
local budget = tonumber(ARGV[4])
local max = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', leases, '-inf', str(now))
if redis.call('ZCARD', leases) >= max then
  local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
  return { 2, str(math.max(tonumber(first[2]) - now, 0)), 0, 0, '-1', 0, '0', 0 }
end
win_spec(ARGV[10])
local s, lost = load_known(tonumber(ARGV[8]), tonumber(ARGV[9]))
local granted, us, cooldown = reserve(s, budget, tonumber(ARGV[11] or '1'))
if not granted then
  local busy = '-1'
  if lost then
    busy = tostring(math.floor(busy_for(s, save(s))))
  elseif loaded then
    busy = tostring(math.floor(busy_for(s, time_to_idle(s, s.fl or rate))))
  end
  return { 0, str(us), s.g, cooldown, busy, s.n, '0', lost and 1 or 0 }
end
local busy = tostring(math.floor(busy_for(s, save(s))))
redis.call('ZADD', leases, str(now + ttl), ARGV[7])
-- The set lives as long as its longest lease, whatever this call's ttl (a replica with a
-- shorter `lease_ttl`, or one after a reload, used to cut every other lease short).
expire_leases(leases)
return { 1, str(us), s.g, 0, busy, s.n, str(now + us), lost and 1 or 0 }
