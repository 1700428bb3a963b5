-- release: give back a reservation whose sender went away, or tokens taken ahead and
-- never spent. Port of bucket::release. Runs after bucket.lua (prepended at compile time).
--
-- KEYS[1]  "<prefix>{<endpoint>}"
-- ARGV[1]  rate   ARGV[2] burst   ARGV[3] recovery (µs)
-- ARGV[4]  generation of the reservation
-- ARGV[5]  tokens given back (absent: 1); for a reservation, its cost
-- ARGV[6]  when they were taken ahead (`store.prefetch`) and not spent: the hold they
--          were taken in (acquire.lua's <hold>). While that hold lasts they no longer count
--          as held ahead; once it is over they already do not, and the count belongs to
--          whatever hold came after (other tokens, still spendable): it is left alone.
--          Empty for a reservation.
-- ARGV[7]  a reservation's start, in µs from now (negative: due already), where ARGV[8]
--          is absent or empty.
-- ARGV[8]  a reservation's start on this store's clock (µs; acquire.lua's <now> plus the
--          ask's wait, lease.lua's <at>): right to the µs (acquire.lua rounds a wait up,
--          so never early), where ARGV[7] is off by how much longer
--          one of the two calls took to arrive than the other. A replica counts ARGV[7]
--          from when its acquire was sent; an acquire held up in Redis (a fork, a slow
--          command, a pause) would put the start it leaves for the next sender that much
--          early, beside the one before it. Empty when the grant named no start.
-- ARGV[9]  with a reservation, the endpoint's windows ("" or absent = none; see
--          bucket.lua's win_spec): the reservation's entry leaves each window's log.
-- Returns  when given back (wholly, in part or, with reservations behind it, not at
--          all): "<busy> <n>", acquire.lua's <busy> and <n> after it (a give-back can
--          shorten the first); -1 when a cooldown voided it (other generation) or the key
--          is gone (an expired key is a fresh full bucket: nothing to give back), which
--          tells the replica nothing new.
--
-- Only what no later reservation was scheduled behind goes back to the balance
-- (bucket::release): reservations behind one that goes keep their starts, and its token
-- back would give a new sender the start of the last of them again. Its start is kept
-- instead (field ho) for the next sender.
--
-- Why atomic: the refund is a read-modify-write of the balance that acquires on other
-- replicas are changing at the same moment.

win_spec(ARGV[9])
local s = load()
if not s or tonumber(ARGV[4]) ~= s.g then
  return -1
end
refill(s)
local n = tonumber(ARGV[5] or '1')
local hold = tonumber(ARGV[6] or '')
local back = n
if hold then
  -- Tokens taken ahead: the bucket refilled only up to burst minus them meanwhile, so
  -- all of them fit back whatever was reserved after them.
  if hold == s.cs and s.ce > now then
    s.cr = math.max(s.cr - n, 0)
  end
else
  -- A reservation (bucket::release): with others scheduled behind it, its start is
  -- kept for the next sender; the latest gives its token back to the balance.
  local base = math.max(s.ts, now)
  local r = effective(s, base)
  local latest = math.max(base + math.max(-s.tk, 0) / r * MICROS, s.la)
  local due = tonumber(ARGV[8] or '') or (now + tonumber(ARGV[7] or '0'))
  -- Its entry leaves every window's log, wherever it is (window::Logs::unrecord).
  if #WIN > 0 then
    for i = 1, #WIN do
      win_unrecord(s.win[i], due, n)
    end
    s.wdirty = true
  end
  local behind = math.max(latest - due, 0) / MICROS * r
  back = math.min(math.max(n - behind, 0), n)
  if behind < 0.5 then
    -- The latest start (within half a slot: clocks differ a little) is free again.
    s.la = math.min(s.la, due - n * MICROS / r)
  end
  if behind >= 0.5 and due > now then
    back = 0
    -- Kept for the next sender of one token only; a costlier reservation's tokens, or
    -- one the windows counted, stay spent (bucket::release).
    if n == 1 and #WIN == 0 then
      local kept = {}
      for w in string.gmatch(s.ho, '%S+') do
        if tonumber(w) > now then
          kept[#kept + 1] = w
        end
      end
      if #kept < 8 then
        kept[#kept + 1] = str(due)
      end
      s.ho = table.concat(kept, ' ')
    end
  end
end
s.tk = math.min(s.tk + back, burst - held_ahead(s))
local busy = math.floor(busy_for(s, save(s)))
return tostring(busy) .. ' ' .. tostring(s.n)
