//! Quotas learned from receivers (`[defaults.adaptive] learn`): what an answer's quota
//! headers publish ([`crate::adapt::published`]) becomes a pace for the endpoint that
//! spends the remaining requests evenly until the reset, never faster than the config
//! allows.
//!
//! A receiver that says "R requests left, reset in T" gets its requests `T / R` apart:
//! the endpoint's policy is lowered to a rate of `R / T` and a burst of 1, so at most R
//! leave before the reset, the first at once (the bucket holds at most one token). Where
//! the receiver says its whole quota Q (and its window W, or the longest time to reset
//! seen stands for it), the pace is never above `Q / W`, so a window's last requests do
//! not crowd into the moments before its reset. The
//! lowered pace holds past the reset for one more window (the policy's `w` where the
//! receiver publishes one, else the time to reset it was learned with), so the requests
//! after a reset keep the pace until the receiver's next answer says its new figure.
//! Every answer that publishes its quota sets the pace afresh; one that says nothing is
//! left pauses the endpoint until the reset ([`crate::adapt::feedback`]).
//!
//! The learned pace lowers the policy each request is admitted with, on the replica that
//! learned it, and reaches the store through that policy: every replica's requests pass
//! through the one shared bucket, and each replica learns from its own answers. A pace
//! learned much slower than the one reservations were handed out at (the configured
//! rate, before the first answer) voids them through the store, as a cooldown does
//! (a 1 ms pause without a decrease), so they are booked again at the learned pace, on
//! every replica.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::adapt::Published;
use crate::config::Policy;

/// A learned pace below this fraction of the one in force voids the reservations made
/// at the faster one (the small drift of `R / T` from answer to answer does not).
const VOID_BELOW: f64 = 0.8;

/// Shortest time to reset a pace is learned from (a reset due now says nothing of the
/// pace until the next one).
const MIN_RESET: Duration = Duration::from_millis(10);

/// What one endpoint's receiver last published, and the pace it leaves.
#[derive(Debug, Clone)]
struct Quota {
    /// Requests per second until `until` (lowering the configured rate).
    rate: f64,
    /// The quota's window, published or the longest time to reset seen.
    window: Duration,
    /// The pace holds until then: the reset and one window past it.
    until: Instant,
    /// What was published, for operators.
    remaining: u64,
    reset_at: Instant,
    source: &'static str,
    /// The configured policy the last lowered one was made from, and that one.
    lowered: Option<(Arc<Policy>, Arc<Policy>)>,
}

/// What `/endpoints` shows of an endpoint's learned quota.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LearnedView {
    /// Requests the receiver said it still takes before its reset.
    pub remaining: u64,
    /// Time until that reset, milliseconds (0 once it passed, while the pace holds).
    pub reset_in_ms: u64,
    /// The header it was read from.
    pub source: String,
    /// The pace it leaves, requests per second.
    pub rate: f64,
}

/// What a new answer changes ([`Learned::learn`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Change {
    /// The new pace, requests per second.
    pub rate: f64,
    /// Reservations handed out at a pace this much faster must be voided.
    pub void: bool,
}

/// The quotas learned on this replica, by endpoint.
#[derive(Default)]
pub struct Learned {
    quotas: Mutex<HashMap<Arc<str>, Quota>>,
    /// How many endpoints hold a quota (the hot path skips the lock when none does).
    count: AtomicUsize,
    /// When an unreadable quota header was last warned about, by endpoint.
    warned: Mutex<HashMap<Arc<str>, Instant>>,
}

impl Learned {
    /// The policy `endpoint`'s requests are admitted with now: `policy`, or `policy`
    /// lowered to the learned pace while it holds. The same `Arc` when nothing is
    /// learned (no allocation on the hot path).
    pub fn apply(&self, endpoint: &str, policy: &Arc<Policy>) -> Arc<Policy> {
        if self.count.load(Ordering::Relaxed) == 0 || !learns(policy) {
            return Arc::clone(policy);
        }
        let now = Instant::now();
        let mut quotas = lock(&self.quotas);
        let Some(q) = quotas.get_mut(endpoint) else {
            return Arc::clone(policy);
        };
        if q.until <= now {
            quotas.remove(endpoint);
            self.count.store(quotas.len(), Ordering::Relaxed);
            return Arc::clone(policy);
        }
        // A receiver allowing more than the config leaves the config's pace.
        if q.rate >= policy.rate {
            return Arc::clone(policy);
        }
        if let Some((from, lowered)) = &q.lowered {
            if Arc::ptr_eq(from, policy) {
                return Arc::clone(lowered);
            }
        }
        let lowered = Arc::new(lower(policy, q.rate));
        q.lowered = Some((Arc::clone(policy), Arc::clone(&lowered)));
        lowered
    }

    /// Takes in what an answer of `endpoint` published; `None` when it leaves no pace
    /// (nothing left and no window to pace the next one by: the pause until the reset
    /// is [`crate::adapt::feedback`]'s).
    pub fn learn(&self, endpoint: &Arc<str>, policy: &Policy, p: Published) -> Option<Change> {
        if p.reset < MIN_RESET {
            return None;
        }
        let now = Instant::now();
        let mut quotas = lock(&self.quotas);
        let prior = quotas.get(&**endpoint).filter(|q| q.until > now);
        let before = prior.map_or(policy.rate, |q| q.rate);
        // The window: as published, else the longest time to reset seen (the answer at
        // a window's start says all of it).
        let window = p
            .window
            .unwrap_or_else(|| prior.map_or(p.reset, |q| q.window).max(p.reset));
        // The whole quota spread over the whole window: never faster, so the last few
        // requests of a window do not crowd into the moments before its reset.
        let even = match p.quota {
            Some(q) if q > 0 && !window.is_zero() => q as f64 / window.as_secs_f64(),
            _ => f64::INFINITY,
        };
        let rate = if p.remaining > 0 {
            (p.remaining as f64 / p.reset.as_secs_f64()).min(even)
        } else if even.is_finite() {
            even
        } else {
            // The pace before holds through the pause.
            prior.map(|q| q.rate)?
        };
        let rate = rate.max(crate::config::MIN_RATE);
        let reset_at = now + p.reset;
        if quotas.len() >= MAX_QUOTAS {
            // Bounded however many endpoints a sender names: those lapsed go first.
            quotas.retain(|_, q| q.until > now);
        }
        if quotas.len() >= MAX_QUOTAS && !quotas.contains_key(&**endpoint) {
            return None;
        }
        quotas.insert(
            Arc::clone(endpoint),
            Quota {
                rate,
                window,
                until: reset_at + window,
                remaining: p.remaining,
                reset_at,
                source: p.source,
                lowered: None,
            },
        );
        self.count.store(quotas.len(), Ordering::Relaxed);
        Some(Change {
            rate,
            void: rate < VOID_BELOW * before,
        })
    }

    /// What `/endpoints` shows for `endpoint`.
    pub fn view(&self, endpoint: &str) -> Option<LearnedView> {
        let now = Instant::now();
        let quotas = lock(&self.quotas);
        let q = quotas.get(endpoint).filter(|q| q.until > now)?;
        Some(LearnedView {
            remaining: q.remaining,
            reset_in_ms: q.reset_at.saturating_duration_since(now).as_millis() as u64,
            source: q.source.to_owned(),
            rate: q.rate,
        })
    }

    /// Whether an unreadable quota header of `endpoint` is to be warned about now: at
    /// most once a minute per endpoint.
    pub fn warn_now(&self, endpoint: &Arc<str>) -> bool {
        let now = Instant::now();
        let mut warned = lock(&self.warned);
        if warned.len() > 10_000 {
            warned.retain(|_, at| now.duration_since(*at) < WARN_EVERY);
        }
        match warned.get(&**endpoint) {
            Some(at) if now.duration_since(*at) < WARN_EVERY => false,
            _ => {
                warned.insert(Arc::clone(endpoint), now);
                true
            }
        }
    }
}

/// The most endpoints whose learned quotas are held at once; past them (all still
/// holding), a new endpoint's quota is not learned.
const MAX_QUOTAS: usize = 100_000;

/// An unreadable quota header is warned about at most this often per endpoint.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Whether `policy` learns from its receiver's quota headers.
pub fn learns(policy: &Policy) -> bool {
    policy.adaptive.is_some_and(|a| a.learn)
        && policy.receiver.quota_headers != crate::config::QuotaHeaders::None
}

/// `policy` at the learned `rate` (never above its own) and a burst of 1: requests
/// `1 / rate` apart, the first at once.
fn lower(policy: &Policy, rate: f64) -> Policy {
    let rate = rate.min(policy.rate);
    let mut p = policy.clone();
    p.rate = rate;
    p.burst = 1.0_f64.min(policy.burst);
    if let Some(a) = p.adaptive.as_mut() {
        a.floor = a.floor.min(rate);
    }
    p
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published(remaining: u64, reset_s: f64) -> Published {
        Published {
            remaining,
            reset: Duration::from_secs_f64(reset_s),
            quota: Some(15),
            window: Some(Duration::from_secs(5)),
            source: "RateLimit",
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_learned_quota_lowers_the_pace_until_a_window_past_its_reset() {
        let l = Learned::default();
        let ep: Arc<str> = "e".into();
        let policy = Arc::new(Policy {
            rate: 50.0,
            burst: 20.0,
            ..Policy::default()
        });
        assert!(Arc::ptr_eq(&l.apply(&ep, &policy), &policy));
        let c = l.learn(&ep, &policy, published(12, 4.0)).unwrap();
        assert_eq!(
            c,
            Change {
                rate: 3.0,
                void: true
            }
        );
        let lowered = l.apply(&ep, &policy);
        assert_eq!((lowered.rate, lowered.burst), (3.0, 1.0));
        assert!(Arc::ptr_eq(&lowered, &l.apply(&ep, &policy)), "made once");
        // The drift of R / T from answer to answer voids nothing.
        assert!(!l.learn(&ep, &policy, published(11, 3.9)).unwrap().void);
        // Nothing left: the next window's even share (15 per 5 s) paces what follows
        // the pause.
        let c = l.learn(&ep, &policy, published(0, 1.0)).unwrap();
        assert_eq!(c.rate, 3.0);
        tokio::time::advance(Duration::from_millis(5900)).await;
        assert_eq!(l.apply(&ep, &policy).rate, 3.0, "a window past the reset");
        assert_eq!(l.view(&ep).unwrap().reset_in_ms, 0);
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(Arc::ptr_eq(&l.apply(&ep, &policy), &policy), "expired");
        assert!(l.view(&ep).is_none());
        // Never above the config's own pace.
        let plenty = Published {
            quota: None,
            window: None,
            ..published(1000, 1.0)
        };
        l.learn(&ep, &policy, plenty).unwrap();
        assert!(Arc::ptr_eq(&l.apply(&ep, &policy), &policy));
    }
}
