-- view: the operator's view of a bucket (read-only). Port of bucket::view.
-- Runs after bucket.lua (prepended at compile time); never calls save.
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  floor ("" = adaptive off)
-- ARGV[5]  the endpoint's windows (acquire.lua's ARGV[10]; absent = none)
-- Returns  nil when the key does not exist, else the strings
--          { tokens, rate, cooldown_us, throttles, at_floor 0|1, floor_for_us,
--            held_ahead (tokens replicas took ahead, until their end),
--            windows: "<used>:<ahead> ..." per window in order (window::Log::used) }
--
-- Why a script: the refill must be computed on Redis's clock (TIME) against a
-- consistent snapshot of the fields, in one round trip.

win_spec(ARGV[5])
local s = load()
if not s then
  return false
end
local uses = {}
for i = 1, #WIN do
  local used, ahead = 0, 0
  for _, e in ipairs(s.win[i]) do
    if e[1] > now then
      ahead = ahead + e[2]
    elseif e[1] > now - WIN[i].per then
      used = used + e[2]
    end
  end
  uses[i] = used .. ':' .. ahead
end
refill(s)
local r = effective(s, now)
local at_floor, floor_for = 0, 0
if ARGV[4] ~= '' and s.dr > 0 and near_floor(r, tonumber(ARGV[4])) then
  at_floor = 1
  if s.fs > 0 then
    floor_for = now - s.fs
  end
end
return {
  str(s.tk), str(r), str(math.max(s.cu - now, 0)), str(s.th), str(at_floor), str(floor_for),
  str(held_ahead(s)), table.concat(uses, ' '),
}
