//! Tokens a replica holds ahead (`store.prefetch`, Redis stores only).
//!
//! When a busy endpoint's batch goes out while its bucket is far from binding,
//! `acquire.lua` may hand the replica a few tokens more than the batch asked for. The
//! replica spends them on the next requests without a round trip, until [`LIFETIME`]
//! after it *sent* the call. The script counts them as held for [`HELD_FOR`], longer and
//! from when it ran: never over while the replica may still spend them, and not over
//! before the replica's give-back of the unspent ones arrives (which ends them at once),
//! so at no moment is a token neither in the bucket nor spendable. The script refills the bucket only up to
//! `burst − tokens held ahead` while they may be spent, so the bucket and every replica's
//! held tokens together never exceed the burst: no window sees more than
//! `rate × W + burst`, exactly as without prefetching.
//!
//! Tokens still unspent at the end are given back (`release.lua`), so a burst that stops
//! loses nothing. A give-back names the script's hold it belongs to ([`Taken::hold`]): one
//! that arrives after its hold ended (a late timer on a busy replica) refunds its tokens
//! but lowers no later hold's count, which would let the bucket refill past
//! `burst − held`; tokens of an endpoint that answered 429 are dropped (its cooldown
//! voids them anyway). A held token is spent only while the caller can vouch that no
//! cooldown of its endpoint has started since its call was sent (on a single Redis: the
//! cooldown notices heard, as for a waiter that slept; see `super::cooldowns`), so a
//! 429 seen by *another* replica stops these tokens as soon as its notice arrives.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::bucket::Ask;

/// How long tokens taken ahead may be spent, from when their call was sent.
pub(super) const LIFETIME: Duration = Duration::from_millis(5);
/// How long the script counts them as held unless given back sooner: the lifetime, and
/// as long again for the give-back of unspent ones (sent at the lifetime's end, on a
/// timer of millisecond grain, from a busy worker) to arrive before it.
pub(super) const HELD_FOR: Duration = Duration::from_millis(10);
/// At most this many tokens are asked ahead at once.
const MOST: u32 = 256;
/// A batch of `n` asks asks this many times `n` ahead.
const PER_ASK: u32 = 4;

/// What one endpoint holds ahead.
struct Held {
    /// Tokens left to spend.
    left: u32,
    /// How many were taken (the size of the next ask when these run out in time).
    size: u32,
    /// Spendable until then.
    until: Instant,
    /// When the call that took the oldest of them was sent: a cooldown announced since
    /// voids them.
    since: Instant,
    /// The endpoint's bucket key, as its cooldown notices name it (made once per call,
    /// not per spend).
    bucket: Box<str>,
    /// The bucket generation they belong to (a cooldown voids them).
    generation: u64,
    /// The script's hold they are counted in (see [`Taken::hold`]).
    hold: u64,
    /// The policy they were taken under: an ask under another (a reload) does not spend them.
    policy: (f64, f64, f64),
    /// Which grant this is, so a late expiry of an earlier one leaves it alone.
    serial: u64,
    /// A top-up call for more is in flight (see [`Credits::top_up`]).
    topping: bool,
}

/// Tokens taken ahead by one call, or left over to give back: how many, the bucket
/// generation and the hold they belong to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Taken {
    /// How many.
    pub(super) n: u32,
    /// The bucket generation (a cooldown voids them).
    pub(super) generation: u64,
    /// The hold the script counts them in (`<hold>` in `lua/acquire.lua`): a give-back
    /// names it, so one that arrives after that hold ended lowers no later hold's count.
    pub(super) hold: u64,
}

/// Leftovers to give back.
pub(super) type Leftover = Taken;

/// Every endpoint's tokens held ahead by this replica.
#[derive(Default)]
pub(super) struct Credits {
    held: Mutex<HashMap<Box<str>, Held>>,
    serial: std::sync::atomic::AtomicU64,
}

fn policy_of(ask: &Ask) -> (f64, f64, f64) {
    (ask.rate, ask.burst, ask.recovery_us)
}

impl Credits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spends one held token of `endpoint` for `ask`; its generation, or `None` when
    /// none is left, they are over, the ask is a confirmation or under another policy,
    /// or `quiet` cannot vouch that no cooldown started since they were asked for (it is
    /// given the bucket key and the instant their call was sent). (The lanes use
    /// [`spend_then`](Self::spend_then), which also decides a top-up.)
    #[cfg(test)]
    pub(super) fn spend(
        &self,
        endpoint: &str,
        ask: &Ask,
        quiet: impl FnOnce(&str, Instant) -> bool,
    ) -> Option<u64> {
        self.spend_then(endpoint, ask, quiet, false).map(|(g, _)| g)
    }

    /// [`spend`](Self::spend), and with `top_ups`, whether that spend calls for a top-up
    /// and for how many, in the same look-up: once the tokens are down to a quarter of
    /// what was taken and no top-up is in flight (one is then marked in flight until
    /// [`keep`](Self::keep) or [`topped`](Self::topped)). Twice what was taken, as in
    /// [`wanted`](Self::wanted): the next tokens arrive before these run out, and the
    /// endpoint's requests never wait for the round trip.
    pub(super) fn spend_then(
        &self,
        endpoint: &str,
        ask: &Ask,
        quiet: impl FnOnce(&str, Instant) -> bool,
        top_ups: bool,
    ) -> Option<(u64, Option<u32>)> {
        if ask.held.is_some() {
            return None;
        }
        let mut held = self.lock();
        let h = held.get_mut(endpoint)?;
        if h.left == 0
            || Instant::now() >= h.until
            || h.policy != policy_of(ask)
            || !quiet(&h.bucket, h.since)
        {
            return None;
        }
        h.left -= 1;
        let top_up = top_ups && !h.topping && h.left <= h.size / 4;
        h.topping |= top_up;
        Some((
            h.generation,
            top_up.then(|| h.size.saturating_mul(2).min(MOST)),
        ))
    }

    /// How many to ask ahead in a call for `batch` asks of `endpoint`: a batch of two or
    /// more (concurrent demand) asks ahead; so does an endpoint whose last tokens ran
    /// out before their end (demand beyond them), twice as many as it held, so a
    /// steady load soon needs one call per [`LIFETIME`] (or per [`MOST`] tokens) rather
    /// than one per small grant, each a round trip its requests wait for. A lone
    /// request on a quiet endpoint asks none.
    pub(super) fn wanted(&self, endpoint: &str, batch: usize) -> u32 {
        let from_batch = if batch >= 2 {
            PER_ASK.saturating_mul(u32::try_from(batch).unwrap_or(MOST))
        } else {
            0
        };
        let from_use = self
            .lock()
            .get(endpoint)
            .filter(|h| h.left == 0 && Instant::now() < h.until)
            .map_or(0, |h| h.size.saturating_mul(2));
        from_batch.max(from_use).min(MOST)
    }

    /// A top-up brought nothing (refused ahead, or failed): another may go.
    pub(super) fn topped(&self, endpoint: &str) {
        if let Some(h) = self.lock().get_mut(endpoint) {
            h.topping = false;
        }
    }

    /// Keeps the tokens `taken` ahead by a call sent at `sent` for the bucket `bucket`
    /// (its key). Returns the grant's serial
    /// and its end (for [`expire`](Self::expire)), and any earlier leftovers that cannot
    /// join them (over, or of another generation, hold or policy) and must be given back
    /// now.
    pub(super) fn keep(
        &self,
        endpoint: &str,
        bucket: &str,
        ask: &Ask,
        taken: Taken,
        sent: Instant,
    ) -> (u64, Instant, Option<Leftover>) {
        let Taken {
            n,
            generation,
            hold,
        } = taken;
        let serial = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let until = sent + LIFETIME;
        let policy = policy_of(ask);
        let mut held = self.lock();
        let mut left = n;
        let mut since = sent;
        let mut leftover = None;
        if let Some(old) = held.get(endpoint) {
            let joins = Instant::now() < old.until
                && old.generation == generation
                && old.hold == hold
                && old.policy == policy;
            if joins {
                // Still spendable: the script counted them in this grant's hold too.
                left += old.left;
                since = since.min(old.since);
            } else if old.left > 0 {
                leftover = Some(Taken {
                    n: old.left,
                    generation: old.generation,
                    hold: old.hold,
                });
            }
        }
        held.insert(
            endpoint.into(),
            Held {
                left,
                size: left,
                until,
                since,
                bucket: bucket.into(),
                generation,
                hold,
                policy,
                serial,
                topping: false,
            },
        );
        (serial, until, leftover)
    }

    /// At the end of grant `serial`: removes it and returns what is left to give back
    /// (`None` when a later grant replaced it or nothing is left).
    pub(super) fn expire(&self, endpoint: &str, serial: u64) -> Option<Leftover> {
        let mut held = self.lock();
        if held.get(endpoint).is_none_or(|h| h.serial != serial) {
            return None;
        }
        let h = held.remove(endpoint)?;
        (h.left > 0).then_some(Taken {
            n: h.left,
            generation: h.generation,
            hold: h.hold,
        })
    }

    /// Forgets what `endpoint` holds (it answered 429: its cooldown voids them).
    pub(super) fn drop_endpoint(&self, endpoint: &str) {
        self.lock().remove(endpoint);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing announced: every held token may be spent.
    fn always(_: &str, _: Instant) -> bool {
        true
    }

    fn ask(rate: f64) -> Ask {
        Ask {
            rate,
            burst: 100.0,
            budget_us: 0.0,
            recovery_us: 0.0,
            held: None,
            cost: 1.0,
            windows: crate::window::Windows::NONE,
        }
    }

    /// `n` tokens of `generation`, in hold 0.
    fn t(n: u32, generation: u64) -> Taken {
        Taken {
            n,
            generation,
            hold: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn held_tokens_are_spent_until_their_end_and_the_rest_comes_back() {
        let c = Credits::default();
        let sent = Instant::now();
        let (serial, until, leftover) = c.keep("e", "k", &ask(10.0), t(3, 7), sent);
        assert_eq!((until, leftover), (sent + LIFETIME, None));
        assert_eq!(c.spend("e", &ask(10.0), always), Some(7));
        // Another policy (a reload) or a confirmation does not spend them.
        assert_eq!(c.spend("e", &ask(11.0), always), None);
        let confirm = Ask {
            held: Some(7),
            ..ask(10.0)
        };
        assert_eq!(c.spend("e", &confirm, always), None);
        tokio::time::advance(LIFETIME).await;
        assert_eq!(c.spend("e", &ask(10.0), always), None, "over at their end");
        assert_eq!(c.expire("e", serial), Some(t(2, 7)), "two were never spent");
        assert_eq!(c.expire("e", serial), None, "given back once");
    }

    #[tokio::test(start_paused = true)]
    async fn demand_decides_how_many_are_asked_ahead() {
        let c = Credits::default();
        assert_eq!(c.wanted("e", 1), 0, "a lone request on a quiet endpoint");
        assert_eq!(c.wanted("e", 3), 12);
        assert_eq!(c.wanted("e", 1000), MOST);
        let (_, _, _) = c.keep("e", "k", &ask(10.0), t(2, 0), Instant::now());
        assert_eq!(c.wanted("e", 1), 0, "tokens left: no need yet");
        c.spend("e", &ask(10.0), always).unwrap();
        c.spend("e", &ask(10.0), always).unwrap();
        assert_eq!(c.wanted("e", 1), 4, "ran out in time: ask twice as many");
        assert_eq!(c.wanted("e", 9), 36, "unless the batch asks more");
        let (_, _, _) = c.keep("e", "k", &ask(10.0), t(200, 0), Instant::now());
        while c.spend("e", &ask(10.0), always).is_some() {}
        assert_eq!(c.wanted("e", 1), MOST, "never more than the cap");
        tokio::time::advance(LIFETIME).await;
        assert_eq!(c.wanted("e", 1), 0, "demand is over");
    }

    #[tokio::test(start_paused = true)]
    async fn a_top_up_goes_once_when_a_quarter_is_left() {
        let c = Credits::default();
        let spend = || c.spend_then("e", &ask(10.0), always, true);
        assert_eq!(spend(), None, "nothing held");
        let (_, _, _) = c.keep("e", "k", &ask(10.0), t(8, 0), Instant::now());
        for _ in 0..5 {
            assert_eq!(spend(), Some((0, None)), "more than a quarter left");
        }
        assert_eq!(
            spend(),
            Some((0, Some(16))),
            "two of eight left: twice as many"
        );
        assert_eq!(spend(), Some((0, None)), "one in flight");
        c.topped("e");
        assert_eq!(
            spend(),
            Some((0, Some(16))),
            "it brought nothing: another may go"
        );
        let (_, _, _) = c.keep("e", "k", &ask(10.0), t(16, 0), Instant::now());
        assert_eq!(spend(), Some((0, None)), "joined: 15 of 16 left");
        assert_eq!(
            c.spend_then("e", &ask(10.0), always, false),
            Some((0, None)),
            "top-ups off"
        );
        tokio::time::advance(LIFETIME).await;
        assert_eq!(spend(), None, "over: the next call asks instead");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_grant_joins_live_tokens_and_hands_back_stale_ones() {
        let c = Credits::default();
        let (first, _, _) = c.keep("e", "k", &ask(10.0), t(2, 1), Instant::now());
        let (_, _, leftover) = c.keep("e", "k", &ask(10.0), t(3, 1), Instant::now());
        assert_eq!(leftover, None);
        assert_eq!(
            c.expire("e", first),
            None,
            "replaced: its expiry leaves the new alone"
        );
        let mut spent = 0;
        while c.spend("e", &ask(10.0), always).is_some() {
            spent += 1;
        }
        assert_eq!(spent, 5);
        // A cooldown in between (another generation): the old ones go back, not along.
        let (_, _, _) = c.keep("f", "k", &ask(10.0), t(2, 1), Instant::now());
        let (_, _, leftover) = c.keep("f", "k", &ask(10.0), t(3, 2), Instant::now());
        assert_eq!(leftover, Some(t(2, 1)));
        c.drop_endpoint("f");
        assert_eq!(c.spend("f", &ask(10.0), always), None);
        // Another hold (the script's ended before this grant): the old ones go back,
        // naming their own hold, so the give-back lowers nothing of the new one's count.
        let (_, _, _) = c.keep("h", "k", &ask(10.0), t(2, 1), Instant::now());
        let new = Taken { hold: 5, ..t(3, 1) };
        let (_, _, leftover) = c.keep("h", "k", &ask(10.0), new, Instant::now());
        assert_eq!(leftover, Some(t(2, 1)));
        let mut spent = 0;
        while c.spend("h", &ask(10.0), always).is_some() {
            spent += 1;
        }
        assert_eq!(spent, 3, "only the new hold's tokens are spent");
    }

    /// A cooldown announced after the call that took the tokens was sent stops them at
    /// once (they are given back at their end, where the store ignores a voided
    /// generation); one announced before it does not. Joined tokens answer for the
    /// oldest call among them.
    #[tokio::test(start_paused = true)]
    async fn a_cooldown_announced_since_they_were_asked_for_stops_held_tokens() {
        let c = Credits::default();
        let first = Instant::now();
        let (serial, _, _) = c.keep("e", "k", &ask(10.0), t(3, 1), first);
        tokio::time::advance(Duration::from_millis(1)).await;
        let announced = Instant::now();
        let heard = |key: &str, since: Instant| {
            assert_eq!(key, "k");
            since > announced
        };
        assert_eq!(
            c.spend("e", &ask(10.0), heard),
            None,
            "announced after the call"
        );
        let (_, _, leftover) = c.keep("e", "k", &ask(10.0), t(2, 1), Instant::now());
        assert_eq!(leftover, None, "joined, not handed back");
        assert_eq!(
            c.spend("e", &ask(10.0), heard),
            None,
            "the joined tokens still answer for the first call"
        );
        assert_eq!(c.expire("e", serial), None, "replaced by the joined grant");
        tokio::time::advance(Duration::from_millis(1)).await;
        let later = Instant::now();
        let (serial, _, _) = c.keep("g", "k", &ask(10.0), t(2, 1), later);
        assert!(later > announced);
        assert_eq!(
            c.spend("g", &ask(10.0), heard),
            Some(1),
            "asked for after it"
        );
        assert_eq!(c.expire("g", serial), Some(t(1, 1)));
    }
}
