//! File descriptors: whether the process's `RLIMIT_NOFILE` holds what
//! `proxy.max_connections` asks for, raised to the hard limit at start when it does
//! not, and the caps the listeners then serve under.
//!
//! A sender connection costs two descriptors (its socket and its upstream's); idle
//! upstream connections ([`crate::idle`]) and admin connections cost one each; the rest
//! of the process (listeners, the store, DNS, the runtime) takes a few dozen. A proxy
//! that accepts until `EMFILE` leaves the admin listener unable to accept a probe, so
//! when the limit is short the proxy's cap is lowered and the admin listener keeps a
//! share in reserve.

use crate::idle::MAX_KEPT;

/// Descriptors kept for everything but connections: listeners, store connections,
/// DNS lookups, the runtime's own.
pub const BASE_RESERVE: u64 = 64;

/// Admin connections at once, when the limit allows. Far above what probes and
/// scrapers need; each costs a task and a socket.
pub const ADMIN_MAX_CONNECTIONS: usize = 4096;

/// The caps the listeners serve under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The soft `RLIMIT_NOFILE` in force (after raising it).
    pub limit: u64,
    /// The hard limit.
    pub hard: u64,
    /// Descriptors the configured caps need at most.
    pub need: u64,
    /// Sender connections served at once.
    pub max_connections: usize,
    /// Admin connections served at once.
    pub admin_connections: usize,
}

impl Budget {
    /// The caps for `max_connections` under a soft limit `limit` (hard `hard`): the
    /// configured ones when the limit holds them all; otherwise an eighth of what the
    /// base leaves goes to admin connections and an eighth to idle upstream ones, and
    /// the proxy gets half the rest (two descriptors a connection), at least one.
    pub fn plan(max_connections: usize, limit: u64, hard: u64) -> Budget {
        let need = 2 * max_connections as u64
            + MAX_KEPT as u64
            + ADMIN_MAX_CONNECTIONS as u64
            + BASE_RESERVE;
        if limit >= need {
            return Budget {
                limit,
                hard,
                need,
                max_connections,
                admin_connections: ADMIN_MAX_CONNECTIONS,
            };
        }
        let spare = limit.saturating_sub(BASE_RESERVE);
        let share = spare / 8;
        let admin = share.clamp(1, ADMIN_MAX_CONNECTIONS as u64);
        let idle = share.min(MAX_KEPT as u64);
        let proxy = (spare.saturating_sub(admin + idle) / 2).max(1);
        Budget {
            limit,
            hard,
            need,
            max_connections: max_connections.min(usize::try_from(proxy).unwrap_or(usize::MAX)),
            admin_connections: usize::try_from(admin).unwrap_or(ADMIN_MAX_CONNECTIONS),
        }
    }

    /// Whether the configured caps had to be lowered.
    pub fn short(&self) -> bool {
        self.limit < self.need
    }
}

/// Raises the soft `RLIMIT_NOFILE` towards what `max_connections` needs (up to the hard
/// limit), and returns the caps to serve under, with a warning naming the figures when
/// the limit is still short. A limit that cannot be read leaves the configured caps.
pub fn fit(max_connections: usize) -> Budget {
    let wanted = Budget::plan(max_connections, u64::MAX, u64::MAX).need;
    let raised = rlimit::increase_nofile_limit(wanted);
    let limits = rlimit::Resource::NOFILE.get();
    let (Ok(limit), Ok((_, hard))) = (raised, limits) else {
        return Budget::plan(max_connections, u64::MAX, u64::MAX);
    };
    let budget = Budget::plan(max_connections, limit, hard);
    if budget.short() {
        tracing::warn!(
            limit = budget.limit,
            hard = budget.hard,
            need = budget.need,
            max_connections,
            serving = budget.max_connections,
            admin = budget.admin_connections,
            "RLIMIT_NOFILE is {} (hard {}), but proxy.max_connections = {max_connections} \
             needs {} descriptors (2 per connection, {MAX_KEPT} idle upstream connections, \
             {ADMIN_MAX_CONNECTIONS} admin connections, {BASE_RESERVE} for the rest): serving \
             at most {} sender connections and {} admin connections at once; raise the limit \
             (`ulimit -n`, systemd `LimitNOFILE=`, the container's nofile ulimit) or lower \
             proxy.max_connections",
            budget.limit,
            budget.hard,
            budget.need,
            budget.max_connections,
            budget.admin_connections,
        );
    }
    budget
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_that_holds_everything_keeps_the_configured_caps() {
        let b = Budget::plan(10_000, 1 << 20, 1 << 20);
        assert!(!b.short());
        assert_eq!((b.max_connections, b.admin_connections), (10_000, 4096));
        assert_eq!(b.need, 20_000 + 4096 + 4096 + 64);
    }

    /// Under 256 descriptors: 192 past the base, 24 for admin, 24 for idle upstream
    /// connections, and 72 sender connections (144 descriptors).
    #[test]
    fn a_short_limit_caps_the_proxy_and_keeps_a_share_for_admin() {
        let b = Budget::plan(10_000, 256, 256);
        assert!(b.short());
        assert_eq!((b.max_connections, b.admin_connections), (72, 24));
        let used = 2 * b.max_connections as u64 + 24 + 24 + BASE_RESERVE;
        assert!(used <= 256, "{used}");
        // A small max_connections within a short limit stays as configured.
        assert_eq!(Budget::plan(10, 256, 256).max_connections, 10);
        // Even a tiny limit serves one of each.
        let tiny = Budget::plan(10_000, 16, 16);
        assert_eq!((tiny.max_connections, tiny.admin_connections), (1, 1));
    }
}
