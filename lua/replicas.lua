-- replicas: registers one sluice replica and counts the live ones, so that each replica
-- knows its share of a limit if it ever has to decide alone (the local fallback).
-- KEYS[1] = <prefix>{_replicas}:heartbeats, a sorted set: replica id -> last seen (ms,
--           server clock); its own hash tag, so it lives in one cluster slot.
-- ARGV[1] = this replica's id
-- ARGV[2] = time to live of a heartbeat, ms
-- Returns the number of replicas seen within the time to live, this one included.
-- Atomic: register, forget the silent ones and count in one step, on Redis' clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZCARD', KEYS[1])
