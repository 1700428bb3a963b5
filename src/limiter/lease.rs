//! In-flight slots as leases: the math, once, as pure functions (the memory store runs
//! them under its lock; `lua/lease.lua` and `lua/renew.lua` are their ports).
//!
//! An endpoint with `max_in_flight = N` holds at most N leases, each with an expiry.
//! A request takes a lease together with its token (one decision), renews it while it
//! runs, and removes it when its response ends. Expired leases are pruned on every
//! decision, so a replica that died without releasing its leases gives them back within
//! `lease_ttl`.

use std::collections::HashMap;

use super::bucket::{self, Ask, BucketState, Outcome};

/// The slot part of a leased acquire.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseAsk {
    /// This request's lease ID (unique within the replica; the store adds the replica).
    pub id: u64,
    /// `max_in_flight`.
    pub max: u32,
    /// Lease life without renewal (µs).
    pub ttl_us: f64,
}

/// What a leased acquire answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Leased {
    /// A slot was free: the token decision, with the slot held iff it was granted.
    Took(Outcome),
    /// Every slot is held; nothing was taken. The soonest lease expires in `retry_us`.
    Busy {
        /// Microseconds until the soonest lease expires (a release may come earlier).
        retry_us: f64,
    },
}

/// Leases of one endpoint: lease ID → expiry (µs on the store's clock).
pub type Leases = HashMap<u64, f64>;

/// Drops expired leases.
pub fn prune(leases: &mut Leases, now: f64) {
    leases.retain(|_, expiry| *expiry > now);
}

/// One decision: a free slot and a token together, or nothing.
pub fn acquire(
    s: &mut BucketState,
    leases: &mut Leases,
    ask: &Ask,
    lease: &LeaseAsk,
    now: f64,
) -> Leased {
    prune(leases, now);
    if leases.len() >= lease.max as usize {
        let soonest = leases.values().copied().fold(f64::INFINITY, f64::min);
        return Leased::Busy {
            retry_us: (soonest - now).max(0.0),
        };
    }
    let outcome = bucket::acquire(s, ask, now);
    if matches!(outcome, Outcome::Granted { .. }) {
        leases.insert(lease.id, now + lease.ttl_us);
    }
    Leased::Took(outcome)
}

/// Extends a live lease; false when it is gone (expired and pruned, or released).
pub fn renew(leases: &mut Leases, lease: &LeaseAsk, now: f64) -> bool {
    prune(leases, now);
    match leases.get_mut(&lease.id) {
        Some(expiry) => {
            *expiry = now + lease.ttl_us;
            true
        }
        None => false,
    }
}

/// Counts a lease whose request is already in flight, taken while another store
/// decided: renewed if present, else added whatever the slots held (the request holds one
/// either way).
pub fn adopt(leases: &mut Leases, lease: &LeaseAsk, now: f64) {
    prune(leases, now);
    leases.insert(lease.id, now + lease.ttl_us);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;

    #[test]
    fn slots_are_bounded_and_expire() {
        let p = Policy::default();
        let ask = Ask::new(&p, 5e6, None);
        let mut s = bucket::fresh(p.burst, 0.0);
        let mut leases = Leases::new();
        let lease = |id| LeaseAsk {
            id,
            max: 2,
            ttl_us: 1e6,
        };
        assert!(matches!(
            acquire(&mut s, &mut leases, &ask, &lease(1), 0.0),
            Leased::Took(Outcome::Granted { .. })
        ));
        acquire(&mut s, &mut leases, &ask, &lease(2), 0.1e6);
        let tokens = s.tokens;
        match acquire(&mut s, &mut leases, &ask, &lease(3), 0.2e6) {
            Leased::Busy { retry_us } => assert!((retry_us - 0.8e6).abs() < 1.0),
            o => panic!("{o:?}"),
        }
        assert_eq!(s.tokens, tokens, "a busy answer takes no token");
        assert!(renew(&mut leases, &lease(1), 0.5e6));
        // Lease 2 expires at 1.1 s; lease 1 (renewed) at 1.5 s.
        assert!(matches!(
            acquire(&mut s, &mut leases, &ask, &lease(3), 1.2e6),
            Leased::Took(Outcome::Granted { .. })
        ));
        assert!(!renew(&mut leases, &lease(2), 1.2e6));
    }
}
