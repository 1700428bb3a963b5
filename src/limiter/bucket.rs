//! The bucket math, once, as pure functions over [`BucketState`].
//!
//! The memory store runs these functions under a lock; `lua/acquire.lua` and
//! `lua/feedback.lua` are line-for-line ports of them, and the shared behaviour suite
//! holds both to the same results. Times are microseconds on the store's own clock
//! (tokio's monotonic clock in memory, which tests can pause; Redis `TIME` in Redis), as
//! `f64`.
//!
//! The model is a reservation bucket: `tokens` is the balance at time `ts`, and may go
//! negative, each missing token being a reservation that starts `1/rate` later than the
//! previous one. A cooldown empties the bucket and moves `ts` to the cooldown's end, so
//! nothing refills (and nothing is granted) before it ends, and the first grant after it
//! comes `1/rate` later: no burst into a receiver that just said stop.

use crate::config::{Adaptive, Policy};
use crate::window::{Logs, WindowUse, Windows};

const MICROS: f64 = 1_000_000.0;

/// The stored state of one endpoint's bucket.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BucketState {
    /// Token balance at `ts`; negative while reservations are outstanding.
    pub tokens: f64,
    /// Time of `tokens` (µs); in the future during a cooldown.
    pub ts: f64,
    /// Rate set by the last decrease; 0 when the rate was never decreased.
    pub dec_rate: f64,
    /// When the climb back from `dec_rate` starts (µs): the end of that cooldown.
    pub dec_at: f64,
    /// No further decrease before this time (µs): "once per cooldown window".
    pub dec_until: f64,
    /// End of the current cooldown (µs).
    pub cool_until: f64,
    /// Bumped whenever a cooldown voids outstanding reservations.
    pub generation: u64,
    /// Throttling responses seen.
    pub throttles: u64,
    /// Since when the rate has been at its floor (µs); 0 when not at the floor.
    pub floor_since: f64,
    /// Starts (µs) of reservations given up with others behind them, for the next
    /// senders to take; 0 where there is none.
    pub holes: [f64; MAX_HOLES],
    /// The latest start handed out (µs) while it is ahead: a new reservation comes
    /// after it, whatever the balance says when the rate has climbed since.
    pub last: f64,
    /// The latest start a cooldown voided (µs): the bucket is kept until it has gone by
    /// (and a second more), so its holder's confirmation meets the generation that
    /// voided it, not a bucket made afresh at generation 0 that would let it go.
    pub voided: f64,
    /// The starts each sliding window counts (`windows`; see [`super::window`]).
    pub windows: Logs,
}

/// How many given-up starts a bucket keeps for the next senders (`BucketState::holes`);
/// one given up while all are kept goes unused.
pub const MAX_HOLES: usize = 8;

/// Takes the earliest start a sender gave up that is still ahead of `now` and within
/// `budget_us` (forgetting those already past): the wait until it.
fn take_hole(s: &mut BucketState, now: f64, budget_us: f64) -> Option<f64> {
    let mut earliest: Option<usize> = None;
    for i in 0..MAX_HOLES {
        let h = s.holes[i];
        if h <= 0.0 {
            continue;
        }
        if h <= now {
            s.holes[i] = 0.0;
        } else if earliest.is_none_or(|e| h < s.holes[e]) {
            earliest = Some(i);
        }
    }
    let i = earliest.filter(|&i| s.holes[i] - now <= budget_us)?;
    let wait = s.holes[i] - now;
    s.holes[i] = 0.0;
    Some(wait)
}

/// What a store answers to one acquire call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// A token is reserved; the request may start after `wait_us`.
    Granted {
        /// Microseconds to wait before sending.
        wait_us: f64,
        /// Generation the reservation belongs to (for refunds and re-checks).
        generation: u64,
        /// Its start on the store's own clock (µs), where the store keeps time apart
        /// from the replica (Redis): a give-back names it ([`Unused::at_us`]). `None`
        /// where the replica's clock is the store's (the memory store), and for a
        /// confirmed reservation (the answer does not say when it started).
        at_us: Option<f64>,
    },
    /// No token within the budget; nothing was consumed.
    Refused {
        /// True when the refusal is due to a cooldown rather than the rate.
        cooldown: bool,
        /// Microseconds until a token (or the end of the cooldown).
        retry_us: f64,
    },
}

/// The parameters of one acquire call.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    /// Configured rate (tokens/s).
    pub rate: f64,
    /// Capacity.
    pub burst: f64,
    /// Longest acceptable wait (µs).
    pub budget_us: f64,
    /// Recovery time (µs) for the climb after a decrease; 0 = adaptive off.
    pub recovery_us: f64,
    /// A reservation already held from this generation: confirm it instead of taking another.
    pub held: Option<u64>,
    /// Tokens (and units of every window) the request spends (`cost`, a whole number ≥ 1).
    pub cost: f64,
    /// The endpoint's sliding windows (`windows`), decided with the bucket.
    pub windows: Windows,
}

impl Ask {
    /// Builds an ask from a policy and a budget.
    pub fn new(policy: &Policy, budget_us: f64, held: Option<u64>) -> Ask {
        Ask {
            rate: policy.rate,
            burst: policy.burst,
            budget_us,
            recovery_us: policy
                .adaptive
                .map_or(0.0, |a| a.recovery.as_secs_f64() * MICROS),
            held,
            cost: f64::from(policy.cost),
            windows: policy.windows,
        }
    }

    /// Whether only the bucket decides, one token a request: what tokens taken ahead
    /// (`store.prefetch`) and given-up starts kept for the next sender (holes) assume.
    pub fn plain(&self) -> bool {
        self.cost == 1.0 && self.windows.is_empty()
    }
}

/// The effective rate at `now`: the configured rate, or the climb from the last decrease.
pub fn effective_rate(s: &BucketState, rate: f64, recovery_us: f64, now: f64) -> f64 {
    if s.dec_rate <= 0.0 || recovery_us <= 0.0 {
        return rate;
    }
    let progress = ((now - s.dec_at) / recovery_us).clamp(0.0, 1.0);
    let r = s.dec_rate + (rate - s.dec_rate) * progress;
    r.min(rate)
}

/// Brings `tokens` forward to `now` (no-op while `ts` is in the future).
///
/// Integrates the rate with the trapezoid rule: the climb is concave (linear, then flat),
/// so the trapezoid never exceeds the true integral — refill can only err on the side of
/// fewer tokens.
fn refill(s: &mut BucketState, ask: &Ask, now: f64) {
    if now <= s.ts {
        return;
    }
    let r0 = effective_rate(s, ask.rate, ask.recovery_us, s.ts);
    let r1 = effective_rate(s, ask.rate, ask.recovery_us, now);
    let gained = (now - s.ts) / MICROS * (r0 + r1) / 2.0;
    s.tokens = (s.tokens + gained).min(ask.burst);
    s.ts = now;
    if s.dec_rate > 0.0 && now - s.dec_at >= ask.recovery_us {
        // Fully recovered: forget the decrease.
        s.dec_rate = 0.0;
        s.floor_since = 0.0;
    }
}

/// A fresh bucket starts full.
pub fn fresh(burst: f64, now: f64) -> BucketState {
    BucketState {
        tokens: burst,
        ts: now,
        ..BucketState::default()
    }
}

/// One decision: refill, then reserve a token or refuse with the exact wait.
pub fn acquire(s: &mut BucketState, ask: &Ask, now: f64) -> Outcome {
    refill(s, ask, now);
    if ask.held == Some(s.generation) {
        // The reservation survived (no cooldown voided it): go.
        return Outcome::Granted {
            wait_us: 0.0,
            generation: s.generation,
            at_us: None,
        };
    }
    // A start a sender gave up comes first: those behind it keep theirs, and the
    // bucket already counted it (one token's worth: a costlier request or one a window
    // counts takes none).
    if s.tokens < 1.0 && ask.plain() {
        if let Some(wait_us) = take_hole(s, now, ask.budget_us) {
            return Outcome::Granted {
                wait_us,
                generation: s.generation,
                at_us: None,
            };
        }
    }
    let rate = effective_rate(s, ask.rate, ask.recovery_us, now.max(s.ts));
    let base = s.ts.max(now);
    let missing = (ask.cost - s.tokens).max(0.0);
    let balance_start = base + missing / rate * MICROS;
    let mut start = balance_start;
    // Never among the starts already handed out: those made while the rate was lower
    // (or held back by a window) keep their places, and the balance, refilled at the
    // climbing rate, would put new ones between them.
    if s.last > now {
        start = start.max(s.last + ask.cost * MICROS / rate);
    }
    // Every window must take the cost too: the start moves to the first instant they
    // all do (never earlier than the bucket's).
    if !ask.windows.is_empty() {
        start = s.windows.earliest(&ask.windows, ask.cost, start, now);
    }
    let wait = start - now;
    if wait > ask.budget_us {
        let cool_left = s.cool_until - now;
        return if cool_left > ask.budget_us {
            Outcome::Refused {
                cooldown: true,
                retry_us: cool_left,
            }
        } else {
            Outcome::Refused {
                cooldown: false,
                retry_us: wait,
            }
        };
    }
    if start > balance_start && !ask.plain() {
        // Held back past where the balance has its tokens (by a window, or behind the
        // latest start): they go at its own start, not before. Taken earlier, the
        // balance would refill meanwhile (up to the burst) and let the next request go
        // right after this one. The bucket is brought to the start (at the rate now,
        // never more than it will refill) and holds still until then, as during a
        // cooldown.
        s.tokens = (s.tokens + (start - base) / MICROS * rate).min(ask.burst);
        s.ts = start;
    }
    s.tokens -= ask.cost;
    if start > now {
        s.last = s.last.max(start);
    }
    if !ask.windows.is_empty() {
        s.windows.record(&ask.windows, start, ask.cost);
    }
    Outcome::Granted {
        wait_us: wait.max(0.0),
        generation: s.generation,
        at_us: None,
    }
}

/// Takes a token unconditionally (the balance may go below zero): a request another
/// bucket already paced leaves, and this bucket must count it.
pub fn charge(s: &mut BucketState, ask: &Ask, now: f64) {
    refill(s, ask, now);
    s.tokens -= ask.cost;
    if !ask.windows.is_empty() {
        s.windows.charge(&ask.windows, ask.cost, now);
    }
}

/// Lowers the balance to at most `most` tokens at `now` (negative: reservations are
/// outstanding until `-most / rate` from now): what this bucket learns of grants another
/// bucket made meanwhile (a fallback's, during an outage of this one). During a
/// cooldown the bound is carried to its end at the rate.
pub fn cap(s: &mut BucketState, ask: &Ask, most: f64, now: f64) {
    refill(s, ask, now);
    let rate = effective_rate(s, ask.rate, ask.recovery_us, now);
    let at_ts = most + (s.ts - now).max(0.0) / MICROS * rate;
    s.tokens = s.tokens.min(at_ts);
    // Starts given up here may have been spent elsewhere meanwhile.
    s.holes = [0.0; MAX_HOLES];
}

/// A reservation given back unspent: which generation granted it and when it was due.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unused {
    /// The generation it was granted in (a cooldown since voided it: nothing comes back).
    pub generation: u64,
    /// Microseconds from now until it was due to start (zero or less: due already).
    pub due_in_us: f64,
    /// Its start on the store's own clock (`at_us` of [`Outcome::Granted`]), where the
    /// store has one: used instead of `due_in_us`, which a store apart from the replica
    /// can only read against its own clock when the give-back arrives, off by how much
    /// longer one of the two calls took to arrive than the other.
    pub at_us: Option<f64>,
}

/// Gives back a reservation whose sender went away, if no cooldown voided it.
///
/// Each reservation starts `1/rate` after the one before it. When one in the middle
/// goes, those behind it keep their starts, so its token cannot go back to the
/// balance: a new reservation would take the start of the last one again, and one more
/// sender would arrive at that instant for every sender that left (arrivals in a window
/// of `1/rate` above `burst`). Its start is kept instead (`holes`) for the next sender
/// to take. Only the latest reservation gives its token back to the balance (Go's
/// `x/time/rate` cancels the same way); a start already past is what the balance
/// regained meanwhile.
pub fn release(s: &mut BucketState, ask: &Ask, unused: Unused, now: f64) {
    if s.generation != unused.generation {
        return;
    }
    refill(s, ask, now);
    let base = s.ts.max(now);
    let rate = effective_rate(s, ask.rate, ask.recovery_us, base);
    let due = now + unused.due_in_us;
    let cost = ask.cost;
    // A window's entry for it goes, wherever it is among the others: the windows hold
    // every start that stays, this one no longer.
    if !ask.windows.is_empty() {
        s.windows
            .unrecord(&ask.windows, unused.at_us.unwrap_or(due), cost);
    }
    // The latest reservation starts when the balance is back at zero, or later (one
    // made while the rate was lower).
    let latest = (base + (-s.tokens).max(0.0) / rate * MICROS).max(s.last);
    let behind = (latest - due).max(0.0) / MICROS * rate;
    // Reservations are 1/rate apart, so `behind` is near a whole number: one or more is
    // a reservation with others behind it (half way, where clocks of a shared store
    // put it off by a little).
    if behind >= 0.5 && due > now {
        // Kept for the next sender of one token; of a costlier request or one the
        // windows count, its tokens stay spent (never more back than was taken).
        if ask.plain() {
            if let Some(free) = s.holes.iter_mut().find(|h| **h <= 0.0) {
                *free = due;
            }
        }
        return;
    }
    if behind < 0.5 {
        // The latest start (within half a slot: a shared store's clocks differ a
        // little) is free again for the next sender. Only then: a start already past
        // with others behind it leaves `last` at the latest of them (as release.lua
        // does), or new starts would go among those made at a lower rate (during a
        // climb, one refund of a past start could put 12 arrivals over the bound).
        s.last = s.last.min(due - cost * MICROS / rate);
    }
    s.tokens = (s.tokens + (cost - behind).clamp(0.0, cost)).min(ask.burst);
}

/// Applies a pause (cooldown) and, when `throttled`, a decrease once per cooldown window.
pub fn feedback(
    s: &mut BucketState,
    ask: &Ask,
    adaptive: &Adaptive,
    pause_us: f64,
    throttled: bool,
    now: f64,
) {
    refill(s, ask, now);
    if throttled {
        s.throttles += 1;
        if now >= s.dec_until {
            let current = effective_rate(s, ask.rate, ask.recovery_us, now);
            let lowered = (current * adaptive.decrease).max(adaptive.floor.min(ask.rate));
            let was_at_floor = s.dec_rate > 0.0 && near_floor(current, adaptive.floor, ask.rate);
            s.dec_rate = lowered;
            s.dec_at = now + pause_us;
            let window = pause_us.max(adaptive.default_cooldown.as_secs_f64() * MICROS);
            s.dec_until = now + window;
            if near_floor(lowered, adaptive.floor, ask.rate) && !was_at_floor {
                s.floor_since = now;
            }
        }
    }
    if pause_us > 0.0 && now + pause_us > s.cool_until {
        // The latest start handed out before this (reservations run up to where the
        // balance is back at zero, or to `last`), voided now.
        let base = s.ts.max(now);
        let rate = effective_rate(s, ask.rate, ask.recovery_us, base);
        let latest = (base + (-s.tokens).max(0.0) / rate * MICROS).max(s.last);
        s.voided = s.voided.max(latest);
        s.cool_until = now + pause_us;
        s.tokens = 0.0;
        s.ts = s.cool_until;
        s.generation += 1;
        s.holes = [0.0; MAX_HOLES];
        s.last = 0.0;
    }
}

/// "At the floor": within the bottom tenth of the range between floor and configured
/// rate. The rate starts climbing right after each cooldown, so an endpoint knocked back
/// by every 429 hovers just above its floor rather than exactly on it.
pub fn near_floor(rate: f64, floor: f64, configured: f64) -> bool {
    rate <= floor + 0.1 * (configured - floor).max(0.0) + 1e-9
}

/// What operators see of a bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct View {
    /// Tokens available now (negative: reservations outstanding).
    pub tokens: f64,
    /// Effective rate now.
    pub rate: f64,
    /// Cooldown left (µs).
    pub cooldown_us: f64,
    /// Throttling responses seen.
    pub throttles: u64,
    /// Whether the rate sits at its floor.
    pub at_floor: bool,
    /// How long it has been at the floor (µs).
    pub floor_for_us: f64,
    /// Tokens replicas took ahead and may still spend (`store.prefetch`, Redis only;
    /// spent or not, counted until their end): not in `tokens` meanwhile.
    pub held_ahead: f64,
    /// Each window's use (`windows`, in configured order; unused places are zero).
    pub windows: [WindowUse; crate::window::MAX_WINDOWS],
}

/// The uses of `list` in a fixed array (a `View` stays `Copy`).
pub fn window_uses(list: &[WindowUse]) -> [WindowUse; crate::window::MAX_WINDOWS] {
    let mut out = [WindowUse::default(); crate::window::MAX_WINDOWS];
    for (o, u) in out.iter_mut().zip(list) {
        *o = *u;
    }
    out
}

/// The operator's view of `s` at `now`.
pub fn view(s: &BucketState, ask: &Ask, floor: Option<f64>, now: f64) -> View {
    let mut v = scalars(s);
    refill(&mut v, ask, now);
    let rate = effective_rate(&v, ask.rate, ask.recovery_us, now);
    let at_floor = floor.is_some_and(|f| v.dec_rate > 0.0 && near_floor(rate, f, ask.rate));
    View {
        tokens: v.tokens,
        rate,
        cooldown_us: (v.cool_until - now).max(0.0),
        throttles: v.throttles,
        at_floor,
        floor_for_us: if at_floor && v.floor_since > 0.0 {
            now - v.floor_since
        } else {
            0.0
        },
        held_ahead: 0.0,
        windows: window_uses(&s.windows.view(&ask.windows, now)),
    }
}

/// The bucket without its window logs (cheap to copy).
fn scalars(s: &BucketState) -> BucketState {
    BucketState {
        windows: Logs::default(),
        ..*s
    }
}

/// True when the bucket holds nothing worth keeping: full, no cooldown, no decrease, and
/// no start it handed out still ahead (a balance refilled at a raised rate can be full
/// while starts made at the lower one are to come: forgetting them let new requests
/// leave among them, and their holders confirm against a fresh bucket's generation).
pub fn idle(s: &BucketState, ask: &Ask, now: f64) -> bool {
    let mut v = scalars(s);
    refill(&mut v, ask, now);
    v.tokens >= ask.burst
        && v.cool_until <= now
        && v.dec_rate <= 0.0
        && v.dec_until <= now
        && v.last <= now
        && (v.voided <= 0.0 || v.voided + MICROS <= now)
        && s.windows.time_to_idle(now) <= 0.0
}

/// Time after which an untouched bucket is [`idle`] again (µs), for key expiry.
pub fn time_to_idle(s: &BucketState, ask: &Ask, floor: f64, now: f64) -> f64 {
    let slowest = floor.min(ask.rate).max(1e-6);
    let refill_time = (ask.burst - s.tokens).max(0.0) / slowest * MICROS;
    let until_ts = (s.ts - now).max(0.0);
    let recovery = if s.dec_rate > 0.0 {
        (s.dec_at + ask.recovery_us - now).max(0.0)
    } else {
        0.0
    };
    let dec_window = (s.dec_until - now).max(0.0);
    // Never forgotten while a start it handed out is ahead, voided or not.
    let handed_out = (s.last.max(s.voided) - now).max(0.0);
    (until_ts + refill_time)
        .max(recovery)
        .max(dec_window)
        .max(handed_out)
        .max(s.windows.time_to_idle(now))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::Window;
    use proptest::prelude::*;
    use std::time::Duration;

    fn policy(rate: f64, burst: f64) -> Policy {
        Policy {
            rate,
            burst,
            max_wait: Duration::from_secs(5),
            adaptive: Some(Adaptive::default()),
            ..Policy::default()
        }
    }

    const S: f64 = MICROS;

    #[test]
    fn fresh_bucket_grants_burst_then_reserves_in_order() {
        let p = policy(10.0, 3.0);
        let ask = Ask::new(&p, 5.0 * S, None);
        let mut s = fresh(3.0, 0.0);
        for _ in 0..3 {
            assert_eq!(
                acquire(&mut s, &ask, 0.0),
                Outcome::Granted {
                    wait_us: 0.0,
                    generation: 0,
                    at_us: None,
                }
            );
        }
        let waits: Vec<f64> = (0..3)
            .map(|_| match acquire(&mut s, &ask, 0.0) {
                Outcome::Granted { wait_us, .. } => wait_us,
                o => panic!("{o:?}"),
            })
            .collect();
        assert!((waits[0] - 0.1 * S).abs() < 1.0);
        assert!((waits[1] - 0.2 * S).abs() < 1.0);
        assert!((waits[2] - 0.3 * S).abs() < 1.0);
    }

    #[test]
    fn refusal_consumes_nothing_and_reports_wait() {
        let p = policy(1.0, 1.0);
        let ask = Ask::new(&p, 0.0, None);
        let mut s = fresh(1.0, 0.0);
        assert!(matches!(
            acquire(&mut s, &ask, 0.0),
            Outcome::Granted { .. }
        ));
        let before = s.clone();
        match acquire(&mut s, &ask, 0.25 * S) {
            Outcome::Refused { cooldown, retry_us } => {
                assert!(!cooldown);
                assert!((retry_us - 0.75 * S).abs() < 1.0);
            }
            o => panic!("{o:?}"),
        }
        assert!((s.tokens - (before.tokens + 0.25)).abs() < 1e-9);
    }

    #[test]
    fn release_refunds_only_same_generation() {
        let p = policy(1.0, 2.0);
        let ask = Ask::new(&p, 10.0 * S, None);
        let mut s = fresh(2.0, 0.0);
        acquire(&mut s, &ask, 0.0);
        acquire(&mut s, &ask, 0.0);
        acquire(&mut s, &ask, 0.0);
        assert!((s.tokens + 1.0).abs() < 1e-9);
        // The latest reservation (due at 1 s) comes back whole.
        let latest = Unused {
            generation: 0,
            due_in_us: S,
            at_us: None,
        };
        release(&mut s, &ask, latest, 0.0);
        assert!(s.tokens.abs() < 1e-9);
        release(
            &mut s,
            &ask,
            Unused {
                generation: 7,
                ..latest
            },
            0.0,
        );
        assert!(s.tokens.abs() < 1e-9);
    }

    /// Rate 10, burst 1, halved by a 429 and back over 10 s.
    fn climbing() -> Policy {
        Policy {
            adaptive: Some(Adaptive {
                decrease: 0.5,
                recovery: Duration::from_secs(10),
                ..Adaptive::default()
            }),
            ..policy(10.0, 1.0)
        }
    }

    /// The most starts in any window of `w` µs, against `rate·w + burst`.
    fn worst_excess(starts: &mut [f64], rate: f64, burst: f64) -> f64 {
        starts.sort_by(f64::total_cmp);
        let mut worst = f64::MIN;
        for (i, a) in starts.iter().enumerate() {
            for (j, b) in starts.iter().enumerate().skip(i) {
                let n = (j - i + 1) as f64;
                worst = worst.max(n - (rate * (b - a) / S + burst));
            }
        }
        worst
    }

    #[test]
    fn the_climb_after_a_decrease_never_puts_new_starts_among_slower_ones() {
        // Rate 10, burst 1; a 429 halves it and pauses 2 s, then it climbs back over
        // 10 s. Sixty senders queued during the pause get starts 1/5 s apart (the rate
        // then); senders asking later, as the balance refills at the climbing rate, must
        // not be given starts among theirs (that would be 125 arrivals in 10 s against
        // 101).
        let p = climbing();
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 100.0 * S, None);
        let mut s = fresh(1.0, 0.0);
        feedback(&mut s, &ask, &a, 2.0 * S, true, 0.0);
        let mut starts = Vec::new();
        let mut take = |s: &mut BucketState, now: f64| {
            if let Outcome::Granted { wait_us, .. } = acquire(s, &ask, now) {
                starts.push(now + wait_us);
            }
        };
        for _ in 0..60 {
            take(&mut s, 0.3 * S);
        }
        for i in 0..165 {
            take(&mut s, 3.0 * S + f64::from(i) * S / 15.0);
        }
        let excess = worst_excess(&mut starts, 10.0, 1.0);
        assert!(excess <= 1e-6, "{excess} starts over rate·W + burst");
    }

    #[test]
    fn a_start_given_back_after_it_passed_keeps_the_climbs_order() {
        // The climb above, and the sender of the 8.0 s start leaves then but never
        // reaches its receiver (its address is refused): its token comes back 50 ms
        // later, a start already past with 30 reservations behind it. Lowering `last`
        // to 7.9 s would give senders asking later starts among the slower ones again:
        // 12 arrivals over the bound.
        let p = climbing();
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 100.0 * S, None);
        let mut s = fresh(1.0, 0.0);
        feedback(&mut s, &ask, &a, 2.0 * S, true, 0.0);
        let mut starts = Vec::new();
        let mut generation = 0;
        for _ in 0..60 {
            if let Outcome::Granted {
                wait_us,
                generation: g,
                ..
            } = acquire(&mut s, &ask, 0.3 * S)
            {
                starts.push(0.3 * S + wait_us);
                generation = g;
            }
        }
        let eight = starts.iter().position(|t| (t - 8.0 * S).abs() < 1.0);
        starts.remove(eight.expect("a start at 8.0 s"));
        let unused = Unused {
            generation,
            due_in_us: -0.05 * S,
            at_us: None,
        };
        let last = s.last;
        release(&mut s, &Ask::new(&p, 0.0, None), unused, 8.05 * S);
        assert_eq!(s.last, last, "the latest start is still the latest");
        for i in 0..165 {
            let now = 8.05 * S + f64::from(i) * S / 15.0;
            if let Outcome::Granted { wait_us, .. } = acquire(&mut s, &ask, now) {
                starts.push(now + wait_us);
            }
        }
        let excess = worst_excess(&mut starts, 10.0, 1.0);
        assert!(excess <= 1e-6, "{excess} starts over rate·W + burst");
    }

    #[test]
    fn a_bucket_with_starts_still_ahead_is_never_idle() {
        // Starts made at 1/s reach 5 s; the rate is raised to 10/s, and by 0.9 s the
        // balance is full at the new rate. A store that evicted such a bucket would meet
        // the next requests with a fresh full one, beside the starts still to come (4
        // arrivals over the bound).
        let old = Ask::new(&policy(1.0, 1.0), 10.0 * S, None);
        let mut s = fresh(1.0, 0.0);
        for _ in 0..6 {
            acquire(&mut s, &old, 0.0);
        }
        let new = Ask::new(&policy(10.0, 1.0), 10.0 * S, None);
        assert!(s.last > 4.9 * S);
        assert!(!idle(&s, &new, 0.9 * S), "starts up to 5 s are ahead");
        assert!(idle(&s, &new, 5.0 * S), "idle once the last start went by");
    }

    #[test]
    fn a_reservation_with_others_behind_it_leaves_its_start_to_the_next_sender() {
        // rate 2, burst 1: one at once, then reservations at 0.5, 1.0, 1.5 s.
        let p = policy(2.0, 1.0);
        let ask = Ask::new(&p, 10.0 * S, None);
        let mut s = fresh(1.0, 0.0);
        for _ in 0..4 {
            acquire(&mut s, &ask, 0.0);
        }
        // The 0.5 s and 1.0 s senders leave: the 1.5 s one keeps its start, the next
        // senders take 0.5 s and 1.0 s, and the one after them 2.0 s (never 1.5 s
        // beside the one waiting there).
        for due in [0.5, 1.0] {
            let unused = Unused {
                generation: 0,
                due_in_us: due * S - 0.1 * S,
                at_us: None,
            };
            release(&mut s, &ask, unused, 0.1 * S);
        }
        for start in [0.5, 1.0, 2.0] {
            match acquire(&mut s, &ask, 0.1 * S) {
                Outcome::Granted { wait_us, .. } => {
                    assert!(
                        (wait_us - (start - 0.1) * S).abs() < 1.0,
                        "{start}: {wait_us}"
                    )
                }
                o => panic!("{o:?}"),
            }
        }
        // Given back from the end, each slot comes back in turn: 2.0 s, then 1.5 s.
        for due in [2.0, 1.5] {
            let unused = Unused {
                generation: 0,
                due_in_us: due * S - 0.1 * S,
                at_us: None,
            };
            release(&mut s, &ask, unused, 0.1 * S);
        }
        match acquire(&mut s, &ask, 0.1 * S) {
            Outcome::Granted { wait_us, .. } => assert!((wait_us - 1.4 * S).abs() < 1.0),
            o => panic!("{o:?}"),
        }
        // A start already past is not handed out.
        let unused = Unused {
            generation: 0,
            due_in_us: 0.9 * S,
            at_us: None,
        };
        release(&mut s, &ask, unused, 0.1 * S);
        match acquire(&mut s, &ask, 1.2 * S) {
            Outcome::Granted { wait_us, .. } => assert!(wait_us > 0.3 * S - 1.0, "{wait_us}"),
            o => panic!("{o:?}"),
        }
    }
    #[test]
    fn cooldown_blocks_then_restarts_empty_at_reduced_rate() {
        let p = policy(10.0, 10.0);
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 1.0 * S, None);
        let mut s = fresh(10.0, 0.0);
        feedback(&mut s, &ask, &a, 2.0 * S, true, 0.0);
        assert_eq!(s.generation, 1);
        match acquire(&mut s, &ask, 0.5 * S) {
            Outcome::Refused { cooldown, retry_us } => {
                assert!(cooldown);
                assert!((retry_us - 1.5 * S).abs() < 1.0);
            }
            o => panic!("{o:?}"),
        }
        // Budget covering the cooldown: first token 1/5 s after its end (rate halved).
        let long = Ask::new(&p, 5.0 * S, None);
        match acquire(&mut s, &long, 0.5 * S) {
            Outcome::Granted {
                wait_us,
                generation,
                at_us: None,
            } => {
                assert_eq!(generation, 1);
                assert!((wait_us - (1.5 + 0.2) * S).abs() < 10.0, "{wait_us}");
            }
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn many_throttles_decrease_once_per_window_and_stop_at_floor() {
        let p = policy(64.0, 10.0);
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 1.0 * S, None);
        let mut s = fresh(10.0, 0.0);
        for _ in 0..50 {
            feedback(&mut s, &ask, &a, 1.0 * S, true, 0.0);
        }
        assert_eq!(s.dec_rate, 32.0);
        assert_eq!(s.throttles, 50);
        let mut now = 0.0;
        for _ in 0..20 {
            now += 1.0 * S;
            feedback(&mut s, &ask, &a, 1.0 * S, true, now);
        }
        assert_eq!(s.dec_rate, a.floor);
        let v = view(&s, &ask, Some(a.floor), now + 0.5 * S);
        assert!(v.at_floor);
        assert!(v.floor_for_us > 0.0);
    }

    #[test]
    fn recovery_climbs_linearly_to_configured_rate() {
        let p = policy(100.0, 10.0);
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 1.0 * S, None);
        let mut s = fresh(10.0, 0.0);
        feedback(&mut s, &ask, &a, 1.0 * S, true, 0.0);
        let rec = a.recovery.as_secs_f64() * S;
        assert_eq!(effective_rate(&s, 100.0, rec, 1.0 * S), 50.0);
        assert!((effective_rate(&s, 100.0, rec, 1.0 * S + rec / 2.0) - 75.0).abs() < 1e-9);
        assert_eq!(effective_rate(&s, 100.0, rec, 1.0 * S + rec), 100.0);
    }

    #[test]
    fn held_reservation_is_confirmed_unless_voided() {
        let p = policy(10.0, 1.0);
        let a = p.adaptive.unwrap();
        let ask = Ask::new(&p, 5.0 * S, None);
        let mut s = fresh(1.0, 0.0);
        acquire(&mut s, &ask, 0.0);
        let Outcome::Granted { generation, .. } = acquire(&mut s, &ask, 0.0) else {
            panic!()
        };
        let confirm = Ask::new(&p, 5.0 * S, Some(generation));
        let tokens = s.tokens;
        assert!(matches!(
            acquire(&mut s, &confirm, 0.1 * S),
            Outcome::Granted { wait_us, .. } if wait_us == 0.0
        ));
        assert!(
            (s.tokens - (tokens + 1.0)).abs() < 1e-6,
            "confirm takes nothing"
        );
        feedback(&mut s, &ask, &a, 1.0 * S, true, 0.1 * S);
        match acquire(&mut s, &confirm, 0.1 * S) {
            Outcome::Granted {
                wait_us,
                generation,
                at_us: None,
            } => {
                assert_eq!(generation, 1);
                assert!(wait_us >= 1.0 * S);
            }
            o => panic!("{o:?}"),
        }
    }

    fn windowed(rate: f64, burst: f64, windows: &[(f64, f64)]) -> Policy {
        let list: Vec<Window> = windows
            .iter()
            .map(|&(limit, per_s)| Window {
                limit,
                per_us: per_s * S,
            })
            .collect();
        Policy {
            windows: Windows::new(&list).unwrap(),
            adaptive: None,
            ..policy(rate, burst)
        }
    }

    /// The most cost starting in any interval of `per` µs (half-open, ending at a start).
    fn most_in(starts: &[(f64, f64)], per: f64) -> f64 {
        let mut sorted = starts.to_vec();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        crate::window::tests::worst(&sorted, per)
    }

    #[test]
    fn a_window_holds_requests_back_until_its_oldest_start_falls_out() {
        // Rate 50, burst 5, at most 20 per 4 s: the bucket lets 20 go within 0.3 s,
        // then the 21st waits for the first start to be 4 s behind, the 22nd for the
        // second, and so on: the window's own pace, in order.
        let p = windowed(50.0, 5.0, &[(20.0, 4.0)]);
        let ask = Ask::new(&p, 10.0 * S, None);
        let mut s = fresh(5.0, 0.0);
        let mut starts = Vec::new();
        for _ in 0..30 {
            match acquire(&mut s, &ask, 0.0) {
                Outcome::Granted { wait_us, .. } => starts.push(wait_us),
                o => panic!("{o:?}"),
            }
        }
        assert!(starts[19] < 0.4 * S, "{}", starts[19]);
        for i in 20..30 {
            let due = (starts[i - 20] + 4.0 * S).max(starts[i - 1] + 0.02 * S);
            assert!((starts[i] - due).abs() < 2.0, "{i}: {starts:?}");
        }
        // With no wait allowed, the refusal names the window's wait.
        let now = 0.5 * S;
        match acquire(&mut s, &Ask::new(&p, 0.0, None), now) {
            Outcome::Refused { cooldown, retry_us } => {
                assert!(!cooldown);
                assert!(
                    (retry_us - (starts[29] + 0.02 * S - now)).abs() < 2.0,
                    "{retry_us}"
                );
            }
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn a_cost_spends_its_tokens_and_its_window_units() {
        // Rate 10, burst 10: a cost of 5 twice empties the bucket, the third waits
        // half a second; a window of 12 per 10 s takes two of them, then holds the
        // third until the first is 10 s behind.
        let p = Policy {
            cost: 5,
            ..windowed(10.0, 10.0, &[(12.0, 10.0)])
        };
        let ask = Ask::new(&p, 20.0 * S, None);
        let mut s = fresh(10.0, 0.0);
        let waits: Vec<f64> = (0..3)
            .map(|_| match acquire(&mut s, &ask, 0.0) {
                Outcome::Granted { wait_us, .. } => wait_us,
                o => panic!("{o:?}"),
            })
            .collect();
        assert_eq!(&waits[..2], &[0.0, 0.0]);
        assert!((waits[2] - 10.0 * S).abs() < 2.0, "{waits:?}");
        // Without the window, the bucket alone: half a second.
        let plain = Ask::new(
            &Policy {
                cost: 5,
                ..policy(10.0, 10.0)
            },
            20.0 * S,
            None,
        );
        let mut b = fresh(10.0, 0.0);
        acquire(&mut b, &plain, 0.0);
        acquire(&mut b, &plain, 0.0);
        match acquire(&mut b, &plain, 0.0) {
            Outcome::Granted { wait_us, .. } => assert!((wait_us - 0.5 * S).abs() < 1.0),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn a_start_given_back_frees_its_window_units_and_no_others() {
        // Rate 100, burst 10, 2 per second: two at once, the third held to 1 s.
        let p = windowed(100.0, 10.0, &[(2.0, 1.0)]);
        let ask = Ask::new(&p, 5.0 * S, None);
        let mut s = fresh(10.0, 0.0);
        acquire(&mut s, &ask, 0.0);
        acquire(&mut s, &ask, 0.0);
        let Outcome::Granted {
            wait_us,
            generation,
            ..
        } = acquire(&mut s, &ask, 0.0)
        else {
            panic!()
        };
        assert!(
            (wait_us - S).abs() < 2.0,
            "the window holds the third: {wait_us}"
        );
        // Its sender leaves before it started: its unit comes back.
        let unused = Unused {
            generation,
            due_in_us: wait_us - 0.1 * S,
            at_us: None,
        };
        release(&mut s, &ask, unused, 0.1 * S);
        let v = view(&s, &ask, None, 0.1 * S);
        assert_eq!((v.windows[0].used, v.windows[0].ahead), (2.0, 0.0));
        // A give-back naming a start no entry has frees nothing.
        let stray = Unused {
            generation,
            due_in_us: 0.3 * S,
            at_us: None,
        };
        release(&mut s, &ask, stray, 0.1 * S);
        let v = view(&s, &ask, None, 0.1 * S);
        assert_eq!(v.windows[0].used, 2.0);
        // The next one takes the start at 1 s again.
        match acquire(&mut s, &ask, 0.2 * S) {
            Outcome::Granted { wait_us, .. } => {
                assert!((wait_us - 0.8 * S).abs() < 2.0, "{wait_us}")
            }
            o => panic!("{o:?}"),
        }
    }

    proptest! {
        /// With windows and costs, starts that stay (senders hang up at random) never
        /// put more than rate·t + burst tokens in an interval of t, nor more than a
        /// window's limit in an interval of its `per`.
        #[test]
        fn windows_and_costs_never_overdraw(
            rate in 1.0f64..100.0,
            burst in 5.0f64..30.0,
            limit in 5u32..40,
            per_ms in 50u32..3000,
            budget_s in 0.0f64..5.0,
            steps in proptest::collection::vec((0u32..200_000, 1u32..5, any::<bool>(), 0usize..100), 1..300),
            with_window in any::<bool>(),
        ) {
            // Without a window, costs of 1 (one token, as ever) mix with costlier ones.
            let p = match with_window {
                true => windowed(rate, burst, &[(f64::from(limit), f64::from(per_ms) / 1000.0)]),
                false => windowed(rate, burst, &[]),
            };
            let per = f64::from(per_ms) * 1000.0;
            let limit = if with_window { limit } else { u32::MAX };
            let mut s = fresh(burst, 0.0);
            let mut now = 0.0;
            let mut starts: Vec<(f64, f64, u64)> = Vec::new();
            for (gap, cost, leaves, which) in steps {
                now += f64::from(gap);
                if leaves {
                    let waiting: Vec<usize> = (0..starts.len()).filter(|&k| starts[k].0 > now).collect();
                    if !waiting.is_empty() {
                        let (start, c, generation) = starts.remove(waiting[which % waiting.len()]);
                        let ask = Ask::new(&Policy { cost: c as u32, ..p.clone() }, 0.0, None);
                        release(&mut s, &ask, Unused { generation, due_in_us: start - now, at_us: None }, now);
                    }
                }
                let ask = Ask::new(&Policy { cost, ..p.clone() }, budget_s * S, None);
                if let Outcome::Granted { wait_us, generation, .. } = acquire(&mut s, &ask, now) {
                    starts.push((now + wait_us, f64::from(cost), generation));
                }
            }
            let pairs: Vec<(f64, f64)> = starts.iter().map(|e| (e.0, e.1)).collect();
            let most = most_in(&pairs, per);
            prop_assert!(most <= f64::from(limit), "{most} in a window of {limit}");
            // The bucket: cost in [a, b] ≤ rate·(b − a) + burst.
            let mut sorted = pairs.clone();
            sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
            for i in 0..sorted.len() {
                let mut sum = 0.0;
                for j in i..sorted.len() {
                    sum += sorted[j].1;
                    let allowed = rate * (sorted[j].0 - sorted[i].0) / S + burst;
                    prop_assert!(sum <= allowed + 1e-6, "{sum} tokens against {allowed}");
                }
            }
        }

        /// Never more than rate·t + burst grants start in any interval of length t.
        #[test]
        fn no_overdraw_for_random_patterns(
            rate in 0.5f64..200.0,
            burst in 1.0f64..50.0,
            budget_s in 0.0f64..3.0,
            gaps in proptest::collection::vec(0u32..200_000, 1..400),
            leaves in proptest::collection::vec((any::<bool>(), 0usize..1000), 400),
        ) {
            let p = Policy { rate, burst, max_wait: Duration::ZERO, adaptive: None, ..Policy::default() };
            let ask = Ask::new(&p, budget_s * S, None);
            let mut s = fresh(burst, 0.0);
            let mut now = 0.0;
            // Every grant's start; a sender still waiting may hang up (any of them, not
            // only the latest), and its start is then no arrival.
            let mut starts: Vec<(f64, u64)> = Vec::new();
            for (i, gap) in gaps.iter().enumerate() {
                now += *gap as f64;
                let (leaves, which) = leaves[i % leaves.len()];
                let waiting: Vec<usize> = (0..starts.len()).filter(|&k| starts[k].0 > now).collect();
                if leaves && !waiting.is_empty() {
                    let (start, generation) = starts.remove(waiting[which % waiting.len()]);
                    release(&mut s, &ask, Unused { generation, due_in_us: start - now, at_us: None }, now);
                }
                if let Outcome::Granted { wait_us, generation, .. } = acquire(&mut s, &ask, now) {
                    starts.push((now + wait_us, generation));
                }
            }
            let mut starts: Vec<f64> = starts.into_iter().map(|(t, _)| t).collect();
            let excess = worst_excess(&mut starts, rate, burst);
            prop_assert!(excess <= 1e-6, "{excess} grants over rate·t + burst (rate {rate}, burst {burst})");
        }

        /// A reserved wait never exceeds the budget, and refusals report a positive retry.
        #[test]
        fn waits_respect_budget(
            rate in 0.5f64..100.0,
            burst in 1.0f64..20.0,
            budget_s in 0.0f64..2.0,
            n in 1usize..200,
        ) {
            let p = Policy { rate, burst, max_wait: Duration::ZERO, adaptive: None, ..Policy::default() };
            let ask = Ask::new(&p, budget_s * S, None);
            let mut s = fresh(burst, 0.0);
            for _ in 0..n {
                match acquire(&mut s, &ask, 0.0) {
                    Outcome::Granted { wait_us, .. } => prop_assert!(wait_us <= budget_s * S + 1e-6),
                    Outcome::Refused { retry_us, .. } => prop_assert!(retry_us > 0.0),
                }
            }
        }
    }
}
