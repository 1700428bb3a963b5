//! The memory ceiling (`proxy.max_memory`) and what sluice does near it, after Envoy's
//! overload manager: the process's resident memory is sampled every
//! [`SAMPLE_EVERY`]; from [`SHED_AT`] of the ceiling sluice is *pressed* until it is
//! back under [`RESUME_BELOW`]. While pressed:
//! - the proxy listener accepts nothing (new senders wait in the listen backlog) while
//!   any sender connection is open: memory still held once all are closed is the
//!   allocator's, and waiting would only stop the service;
//! - every sender connection, tunnel or intercepted session with no request in flight
//!   is closed (idle keep-alive connections, tunnels, heads still arriving): the
//!   connections that hold memory without doing work go first;
//! - a response head still arriving in the plain lane is cut at [`PRESSED_RESPONSE_HEAD`]
//!   (502), so receivers that stall large heads cannot hold 400 KB each.
//!
//! Heads in the plain lane, request and response, are also held to a byte budget at
//! all times, exact rather than sampled: past [`FREE_HEAD`], a head's buffer takes its
//! bytes from [`HEAD_SHARE`] of the ceiling before it grows ([`HeadBytes`]), and a head
//! that finds the budget spent is refused instead of read further (a request head: 503
//! `overloaded`, then the connection closes; a response head: 502); the buffer is given
//! back once the head is parsed.
//!
//! Requests in flight (waiting for their token, or being answered) are kept. The
//! admin listener is never paused, so `/healthz` answers throughout.
//!
//! The ceiling is `proxy.max_memory` when set, else the cgroup's memory limit (v2
//! `memory.max`, v1 `memory.limit_in_bytes`) when there is one, else
//! [`DEFAULT_MAX_MEMORY`].

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// The ceiling without `proxy.max_memory` and without a cgroup limit.
pub const DEFAULT_MAX_MEMORY: u64 = 1 << 30;
/// Pressed from this fraction of the ceiling...
pub const SHED_AT: f64 = 0.80;
/// ...until resident memory is back under this one.
pub const RESUME_BELOW: f64 = 0.70;
/// After pressure ended with memory still resident, it begins again this much (a
/// fraction of the ceiling) higher...
pub const REPRESS_STEP: f64 = 0.05;
/// ...and never higher than this.
pub const REPRESS_MOST: f64 = 0.95;
/// How often resident memory is read.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// Longest response head the plain lane reads while pressed.
pub const PRESSED_RESPONSE_HEAD: usize = 64 * 1024;

static PRESSED: AtomicBool = AtomicBool::new(false);

fn channel() -> &'static watch::Sender<bool> {
    static CHANNEL: OnceLock<watch::Sender<bool>> = OnceLock::new();
    CHANNEL.get_or_init(|| watch::channel(false).0)
}

/// Whether sluice is pressed now (one atomic load).
pub fn pressed() -> bool {
    PRESSED.load(Ordering::Relaxed)
}

/// A receiver that changes when sluice becomes pressed or relieved.
pub fn subscribe() -> watch::Receiver<bool> {
    channel().subscribe()
}

fn set(pressed: bool) {
    if PRESSED.swap(pressed, Ordering::AcqRel) != pressed {
        channel().send_replace(pressed);
    }
}

/// Where a ceiling came from (logged at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `proxy.max_memory`.
    Config,
    /// The cgroup's memory limit.
    Cgroup,
    /// [`DEFAULT_MAX_MEMORY`].
    Default,
}

/// The ceiling: `configured` (non-zero), the cgroup's limit, or the default.
pub fn ceiling(configured: u64) -> (u64, Source) {
    if configured > 0 {
        return (configured, Source::Config);
    }
    match cgroup_limit() {
        Some(limit) => (limit, Source::Cgroup),
        None => (DEFAULT_MAX_MEMORY, Source::Default),
    }
}

/// The cgroup memory limit of this process, when there is one (v2, then v1). "max", and
/// v1's "unlimited" (a page-rounded `i64::MAX`), are none.
pub fn cgroup_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let v = read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))?;
    v.trim()
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0 && *n < 1 << 60)
}

/// This process's resident memory (bytes), from `/proc/self/status`; `None` where there
/// is no procfs.
pub fn rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Samples resident memory until `stop` fires, pressing and relieving sluice against
/// `ceiling` (see the module docs); `open` counts the sender connections,
/// `pressed_gauge` shows the state.
///
/// Freed memory is not always given back to the system (the allocator keeps it for
/// reuse), so resident memory alone could keep sluice pressed after the connections
/// that took it are gone. Pressure also ends once half the connections open when it
/// began have closed; it then begins again only past what was resident at that moment
/// plus [`REPRESS_STEP`] of the ceiling (at most [`REPRESS_MOST`] of it), until memory
/// is back under [`RESUME_BELOW`].
pub async fn watch_memory(
    ceiling: u64,
    open: Gauge,
    pressed_gauge: Gauge,
    mut stop: watch::Receiver<bool>,
) {
    let of = |f: f64| (ceiling as f64 * f) as u64;
    let (resume, most) = (of(RESUME_BELOW), of(REPRESS_MOST));
    let mut shed = of(SHED_AT);
    let mut open_when_pressed = 0;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Shutdown: stop sampling.
            _ = stop.wait_for(|down| *down) => return,
        }
        let Some(now) = rss() else { return };
        let was = pressed();
        if !was && now >= shed {
            tracing::warn!(
                rss = now,
                ceiling,
                "memory pressure: not accepting, closing connections with no request in flight"
            );
            open_when_pressed = open.get();
            set(true);
        } else if was && (now < resume || open.get() <= open_when_pressed / 2) {
            tracing::info!(rss = now, ceiling, "memory pressure over: accepting again");
            set(false);
            shed = if now < resume {
                of(SHED_AT)
            } else {
                (now + of(REPRESS_STEP)).clamp(of(SHED_AT), most)
            };
        } else if !was && now < resume {
            shed = of(SHED_AT);
        }
        pressed_gauge.set(i64::from(pressed()));
    }
}

/// Resolves once a new sender connection may be accepted: sluice is not pressed, or no
/// sender connection is open (`open`).
pub async fn until_accepting(open: &Gauge) {
    if !pressed() {
        return;
    }
    let mut rx = subscribe();
    loop {
        if !pressed() || open.get() <= 0 {
            return;
        }
        // Relieved, or a look again soon: the last connections may close meanwhile.
        let _ = tokio::time::timeout(SAMPLE_EVERY, rx.changed()).await;
    }
}

/// Head bytes (request and response) the plain lane holds past [`FREE_HEAD`] per
/// head, in all.
static HEAD_BYTES: AtomicUsize = AtomicUsize::new(0);
/// What [`HEAD_BYTES`] may reach: [`HEAD_SHARE`] of the ceiling ([`set_ceiling`]).
static HEAD_BUDGET: AtomicUsize = AtomicUsize::new(usize::MAX);
/// A head's buffer up to this size is not counted: the connection cap bounds those
/// (webhook heads are well under it).
pub const FREE_HEAD: usize = 8 * 1024;
/// The share of the ceiling that heads being read may hold past [`FREE_HEAD`].
pub const HEAD_SHARE: f64 = 0.125;

/// Sets the byte budget of buffered heads and the number of waiting requests from the
/// ceiling.
pub fn set_ceiling(ceiling: u64) {
    let budget = usize::try_from((ceiling as f64 * HEAD_SHARE) as u64).unwrap_or(usize::MAX);
    HEAD_BUDGET.store(budget, Ordering::Relaxed);
    let waiters = (ceiling as f64 * WAITER_SHARE) as u64 / WAITER_BYTES;
    MAX_WAITERS.store(
        usize::try_from(waiters).unwrap_or(usize::MAX),
        Ordering::Relaxed,
    );
    let conns = (ceiling as f64 * CONNECTION_SHARE) as u64 / CONNECTION_BYTES;
    MAX_CONNECTIONS.store(
        usize::try_from(conns).unwrap_or(usize::MAX),
        Ordering::Relaxed,
    );
}

/// What one open sender connection is counted at: its task, the lane's read and write
/// buffers and its upstream connection's (about 20 KB measured, rounded up).
pub const CONNECTION_BYTES: u64 = 24 * 1024;
/// The share of the ceiling open sender connections may hold: the proxy listener
/// serves at most this many at once ([`connection_cap`]), past `proxy.max_connections`
/// when that is lower. Connections past it wait in the backlog, costing no memory of
/// sluice's, instead of arriving faster than memory is sampled.
pub const CONNECTION_SHARE: f64 = 0.5;

/// What [`connection_cap`] answers ([`set_ceiling`]).
static MAX_CONNECTIONS: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Most sender connections the ceiling allows open at once: [`CONNECTION_SHARE`] of it
/// at [`CONNECTION_BYTES`] each.
pub fn connection_cap() -> usize {
    MAX_CONNECTIONS.load(Ordering::Relaxed).max(1)
}

/// What one request waiting for its token is counted at: its task, its head and its
/// sender connection's buffers (about 24 KB measured, rounded up).
pub const WAITER_BYTES: u64 = 32 * 1024;
/// The share of the ceiling requests waiting for their token may hold: past it (or while
/// sluice is pressed) a new request is refused `503 overloaded` instead of parked.
pub const WAITER_SHARE: f64 = 0.25;

/// Requests now waiting for their token.
static WAITERS: AtomicUsize = AtomicUsize::new(0);
/// What [`WAITERS`] may reach ([`set_ceiling`]).
static MAX_WAITERS: AtomicUsize = AtomicUsize::new(usize::MAX);

/// A request's place among the waiting ones, given back when dropped.
#[derive(Debug)]
pub struct Waiting(());

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A place to wait for a token, or `None` while sluice is pressed or the waiting
/// requests' share of the ceiling is taken: a waiter costs memory a sender can multiply
/// at will, so past the share new ones are refused rather than parked.
pub fn wait() -> Option<Waiting> {
    if pressed() {
        return None;
    }
    let most = MAX_WAITERS.load(Ordering::Relaxed);
    WAITERS
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < most).then_some(n + 1)
        })
        .ok()
        .map(|_| Waiting(()))
}

/// One head's claim on the budget of buffered heads, given back when dropped.
#[derive(Debug, Default)]
pub struct HeadBytes(usize);

impl HeadBytes {
    /// Covers a head buffer of `capacity` bytes (its part past [`FREE_HEAD`]); false
    /// when the budget cannot: the head is then refused instead of read further.
    pub fn cover(&mut self, capacity: usize) -> bool {
        let want = capacity.saturating_sub(FREE_HEAD);
        if want <= self.0 {
            return true;
        }
        let more = want - self.0;
        let budget = HEAD_BUDGET.load(Ordering::Relaxed);
        let took = HEAD_BYTES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(more).filter(|n| *n <= budget)
        });
        if took.is_ok() {
            self.0 = want;
        }
        took.is_ok()
    }
}

impl Drop for HeadBytes {
    fn drop(&mut self) {
        HEAD_BYTES.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// What `buf` may grow to on the lane's next read into it (it reserves 8 KiB when
/// short of 1 KiB of room, and a full buffer doubles).
pub fn next_capacity(buf: &bytes::BytesMut) -> usize {
    let (len, cap) = (buf.len(), buf.capacity());
    if cap - len < 1024 {
        (cap * 2).max(len + 8192)
    } else {
        cap
    }
}

/// The longest response head the plain lane reads now: `normal`, or
/// [`PRESSED_RESPONSE_HEAD`] while pressed.
pub fn response_head_limit(normal: usize) -> usize {
    if pressed() {
        normal.min(PRESSED_RESPONSE_HEAD)
    } else {
        normal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_ceiling_wins_and_rss_is_read() {
        assert_eq!(ceiling(64 << 20), (64 << 20, Source::Config));
        let (n, source) = ceiling(0);
        assert!(n > 0 && source != Source::Config);
        assert!(rss().is_some_and(|r| r > 0));
    }
}
