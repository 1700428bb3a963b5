//! Sliding windows, the math once as pure functions over [`Logs`]: at most `limit`
//! cost units start in any interval of length `per` (`windows = [{ limit, per }]`).
//!
//! `bucket::acquire` asks [`Logs::earliest`] for the first start at or after the
//! bucket's own at which every window takes the request's cost, and records the start
//! there ([`Logs::record`]) in the same decision; `lua/bucket.lua` ports these functions
//! line for line (`win_*`). Times are microseconds on the store's clock, as in `bucket`.
//!
//! Each window keeps a log of `(start, cost)` entries in order of start. A new start is
//! never before the latest entry, so only the interval ending at it can go over: the
//! earliest start is where enough of the oldest entries have fallen `per` behind it.
//! Entries `per` or more behind the present are dropped (they share no interval with a
//! start to come).
//!
//! Bounded state: a log holds at most [`MAX_ENTRIES`] entries. Past that, the two
//! adjacent entries closest in time become one, at the *later* time with both costs:
//! cost only ever moves later, so every interval counts at least what really started in
//! it (the window is never overdrawn), and it is held back at most by the gap it moved
//! across (the closest pair of entries within one `per`, at most `per / (MAX_ENTRIES −
//! 1)` apart when the log is full of live entries).
//!
//! A start given back ([`Logs::unrecord`]) takes its cost off the entry at its own time
//! only: one merged into a later entry stays counted there (never more freed than spent).

/// Most windows an endpoint may have (the config refuses more).
pub const MAX_WINDOWS: usize = 4;
/// Most entries a window's log keeps exactly; past it, the closest two are merged.
pub const MAX_ENTRIES: usize = 32;
/// How far (µs) the start a give-back names may be from the entry it took: the
/// memory store counts it from the replica's clock, Redis rounds a wait up to the µs.
const SAME_START_US: f64 = 1.0;
/// A start that waits for an entry to fall out of its window comes this much (µs) after
/// the entry's `at + per`: in doubles, `at + per − per` can land a hair below `at`,
/// and a Redis wait is rounded up to the µs; either would leave the entry counted.
const EDGE_US: f64 = 1.0;

/// One window: at most `limit` cost units in any interval of `per_us`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Window {
    /// Cost units allowed in any interval of `per_us` (a whole number ≥ 1).
    pub limit: f64,
    /// The interval's length (µs, > 0).
    pub per_us: f64,
}

/// An endpoint's windows (none to [`MAX_WINDOWS`]), kept inline so an `Ask` stays `Copy`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Windows {
    list: [Window; MAX_WINDOWS],
    len: u8,
}

impl Windows {
    /// No window: the bucket alone decides.
    pub const NONE: Windows = Windows {
        list: [Window {
            limit: 0.0,
            per_us: 0.0,
        }; MAX_WINDOWS],
        len: 0,
    };

    /// The windows of `list`; `None` when there are more than [`MAX_WINDOWS`].
    pub fn new(list: &[Window]) -> Option<Windows> {
        if list.len() > MAX_WINDOWS {
            return None;
        }
        let mut w = Windows::NONE;
        w.list[..list.len()].copy_from_slice(list);
        w.len = list.len() as u8;
        Some(w)
    }

    /// The windows, in configured order.
    pub fn as_slice(&self) -> &[Window] {
        &self.list[..usize::from(self.len)]
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The windows as the Lua scripts read them: `"<limit>:<per µs> ..."` (whole
    /// numbers; empty when there is none).
    pub fn spec(&self) -> String {
        let mut out = String::new();
        for w in self.as_slice() {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(&format!("{}:{}", w.limit as u64, w.per_us as u64));
        }
        out
    }

    /// Each limit divided among `n` replicas (at least one unit each): a replica's share
    /// while the shared store is out.
    pub fn shared(mut self, n: f64) -> Windows {
        for w in &mut self.list[..usize::from(self.len)] {
            w.limit = (w.limit / n).floor().max(1.0);
        }
        self
    }
}

/// Whether a request of `cost` can ever leave: a whole number ≥ 1, never over `burst`
/// nor over a window's `limit` (it would wait forever). The reason when not.
pub fn cost_fits(cost: f64, burst: f64, ws: &Windows) -> Result<(), String> {
    if !(cost >= 1.0 && cost.fract() == 0.0) {
        return Err(format!("a cost is a whole number ≥ 1, not {cost}"));
    }
    if cost > burst {
        return Err(format!("a cost of {cost} can never fit a burst of {burst}"));
    }
    if let Some(w) = ws.as_slice().iter().find(|w| cost > w.limit) {
        return Err(format!(
            "a cost of {cost} can never fit a window's limit of {}",
            w.limit
        ));
    }
    Ok(())
}

/// One window's log: `(start µs, cost)` in order of start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Log {
    /// The window's `per` (µs): what the log is matched to the config by.
    pub per_us: f64,
    /// The entries, oldest first.
    pub entries: Vec<(f64, f64)>,
}

impl Log {
    /// Drops the entries `per` or more behind `now`: no interval ending at or after
    /// `now` holds them.
    pub fn prune(&mut self, now: f64) {
        let gone = self
            .entries
            .iter()
            .take_while(|e| e.0 <= now - self.per_us)
            .count();
        self.entries.drain(..gone);
    }

    /// The earliest start `t ≥ from` (and not before the latest entry) at which the
    /// interval `(t − per, t]` holds at most `limit − cost`: infinite when `cost` is
    /// over `limit` (it never fits).
    pub fn earliest(&self, limit: f64, cost: f64, from: f64) -> f64 {
        if cost > limit {
            return f64::INFINITY;
        }
        let t0 = self.entries.last().map_or(from, |e| e.0.max(from));
        let total: f64 = self.entries.iter().map(|e| e.1).sum();
        let mut excess = total + cost - limit;
        if excess <= 0.0 {
            return t0;
        }
        for &(at, c) in &self.entries {
            excess -= c;
            if excess <= 0.0 {
                return t0.max(at + self.per_us + EDGE_US);
            }
        }
        t0
    }

    /// Appends a start (never before the latest entry), merging the closest two entries
    /// into the later one's time when the log is full.
    pub fn record(&mut self, at: f64, cost: f64) {
        self.entries.push((at, cost));
        if self.entries.len() > MAX_ENTRIES {
            let mut best = 1;
            let mut gap = f64::INFINITY;
            for i in 1..self.entries.len() {
                let g = self.entries[i].0 - self.entries[i - 1].0;
                if g < gap {
                    gap = g;
                    best = i;
                }
            }
            self.entries[best].1 += self.entries[best - 1].1;
            self.entries.remove(best - 1);
        }
    }

    /// Takes `cost` off the entry at `at` (within a µs), if it is still there.
    pub fn unrecord(&mut self, at: f64, cost: f64) {
        let found = self
            .entries
            .iter()
            .position(|e| (e.0 - at).abs() <= SAME_START_US);
        if let Some(i) = found {
            self.entries[i].1 -= cost.min(self.entries[i].1);
            if self.entries[i].1 <= 0.0 {
                self.entries.remove(i);
            }
        }
    }

    /// Cost units in `(now − per, now]` and starting after `now` (reserved).
    pub fn used(&self, now: f64) -> (f64, f64) {
        let mut used = 0.0;
        let mut ahead = 0.0;
        for &(at, c) in &self.entries {
            if at > now {
                ahead += c;
            } else if at > now - self.per_us {
                used += c;
            }
        }
        (used, ahead)
    }
}

/// What operators see of one window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WindowUse {
    /// The window.
    pub window: Window,
    /// Cost units started in the last `per`.
    pub used: f64,
    /// Cost units reserved to start later.
    pub ahead: f64,
}

/// The logs of an endpoint's windows, matched to the configured ones by `per`: a reload
/// that changes only a limit keeps the log; a window with a new `per` starts empty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logs(Vec<Log>);

impl Logs {
    /// The log of each of `ws`, made when missing; logs of windows no longer
    /// configured are dropped.
    fn sync(&mut self, ws: &Windows) {
        let matches = self.0.len() == ws.as_slice().len()
            && self
                .0
                .iter()
                .zip(ws.as_slice())
                .all(|(l, w)| l.per_us == w.per_us);
        if matches {
            return;
        }
        let mut old = std::mem::take(&mut self.0);
        for w in ws.as_slice() {
            let log = match old.iter().position(|l| l.per_us == w.per_us) {
                Some(i) => old.swap_remove(i),
                None => Log {
                    per_us: w.per_us,
                    entries: Vec::new(),
                },
            };
            self.0.push(log);
        }
    }

    /// The earliest start at or after `from` that every window of `ws` takes `cost` at
    /// (see [`Log::earliest`]), forgetting entries no longer needed at `now`.
    pub fn earliest(&mut self, ws: &Windows, cost: f64, from: f64, now: f64) -> f64 {
        self.sync(ws);
        let mut t = from;
        for (log, w) in self.0.iter_mut().zip(ws.as_slice()) {
            log.prune(now);
            t = t.max(log.earliest(w.limit, cost, from));
        }
        t
    }

    /// Records a start of `cost` at `at` in every window (after [`earliest`](Self::earliest)).
    pub fn record(&mut self, ws: &Windows, at: f64, cost: f64) {
        self.sync(ws);
        for log in &mut self.0 {
            log.record(at, cost);
        }
    }

    /// Records a start that had to leave at `now` whatever the windows say (another
    /// bucket paced it): at the latest entry when that is later, so entries stay in
    /// order and the cost is counted no earlier than it was.
    pub fn charge(&mut self, ws: &Windows, cost: f64, now: f64) {
        self.sync(ws);
        for log in &mut self.0 {
            log.prune(now);
            let at = log.entries.last().map_or(now, |e| e.0.max(now));
            log.record(at, cost);
        }
    }

    /// Gives back a start of `cost` at `at` (see [`Log::unrecord`]).
    pub fn unrecord(&mut self, ws: &Windows, at: f64, cost: f64) {
        self.sync(ws);
        for log in &mut self.0 {
            log.unrecord(at, cost);
        }
    }

    /// Each configured window's use at `now`.
    pub fn view(&self, ws: &Windows, now: f64) -> Vec<WindowUse> {
        ws.as_slice()
            .iter()
            .map(|w| {
                let (used, ahead) = self
                    .0
                    .iter()
                    .find(|l| l.per_us == w.per_us)
                    .map_or((0.0, 0.0), |l| l.used(now));
                WindowUse {
                    window: *w,
                    used,
                    ahead,
                }
            })
            .collect()
    }

    /// Time (µs) until no entry shares an interval with a start at or after then: the
    /// logs can be forgotten (a fresh, empty one decides the same).
    pub fn time_to_idle(&self, now: f64) -> f64 {
        self.0
            .iter()
            .filter_map(|l| l.entries.last().map(|e| e.0 + l.per_us - now))
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: f64 = 1_000_000.0;

    fn log(per_s: f64) -> Log {
        Log {
            per_us: per_s * S,
            entries: Vec::new(),
        }
    }

    #[test]
    fn a_full_window_frees_as_its_oldest_starts_fall_behind() {
        // 3 per second: starts at 0, 0.2, 0.4 fill it; the next fits at 1.0 (the
        // start at 0 then falls out of (t − 1 s, t]), a cost of 2 at 1.2.
        let mut l = log(1.0);
        for t in [0.0, 0.2, 0.4] {
            assert_eq!(l.earliest(3.0, 1.0, t * S), t * S);
            l.record(t * S, 1.0);
        }
        assert_eq!(l.earliest(3.0, 1.0, 0.5 * S), 1.0 * S + EDGE_US);
        assert_eq!(l.earliest(3.0, 2.0, 0.5 * S), 1.2 * S + EDGE_US);
        assert_eq!(l.earliest(3.0, 4.0, 0.5 * S), f64::INFINITY, "never fits");
        // From later than the binding point, the window does not bind.
        assert_eq!(l.earliest(3.0, 1.0, 1.1 * S), 1.1 * S);
    }

    #[test]
    fn a_start_given_back_frees_only_its_own_cost() {
        let mut l = log(1.0);
        l.record(0.0, 2.0);
        l.record(0.5 * S, 1.0);
        l.unrecord(0.5 * S + 0.4, 1.0);
        assert_eq!(l.entries, vec![(0.0, 2.0)]);
        // Nothing there: nothing freed.
        l.unrecord(0.7 * S, 1.0);
        assert_eq!(l.entries, vec![(0.0, 2.0)]);
        l.unrecord(0.0, 5.0);
        assert!(l.entries.is_empty(), "never below zero");
    }

    #[test]
    fn a_full_log_merges_the_closest_two_at_the_later_time() {
        let mut l = log(100.0);
        for i in 0..MAX_ENTRIES {
            l.record(i as f64 * S, 1.0);
        }
        // One closer to its neighbour than any other pair: merged into it.
        l.record(MAX_ENTRIES as f64 * S - 0.5 * S, 1.0);
        assert_eq!(l.entries.len(), MAX_ENTRIES);
        assert_eq!(
            l.entries.last(),
            Some(&(MAX_ENTRIES as f64 * S - 0.5 * S, 2.0))
        );
        let total: f64 = l.entries.iter().map(|e| e.1).sum();
        assert_eq!(total, MAX_ENTRIES as f64 + 1.0, "no cost lost");
    }

    #[test]
    fn logs_follow_the_configured_windows_by_per() {
        let ws = Windows::new(&[
            Window {
                limit: 2.0,
                per_us: S,
            },
            Window {
                limit: 5.0,
                per_us: 10.0 * S,
            },
        ])
        .unwrap();
        let mut logs = Logs::default();
        assert_eq!(logs.earliest(&ws, 1.0, 0.0, 0.0), 0.0);
        logs.record(&ws, 0.0, 1.0);
        logs.record(&ws, 0.0, 1.0);
        // The second-wide window binds first...
        assert_eq!(logs.earliest(&ws, 1.0, 0.0, 0.0), S + EDGE_US);
        for t in [1.0, 1.0, 2.0] {
            logs.record(&ws, t * S, 1.0);
        }
        let v = logs.view(&ws, 1.5 * S);
        assert_eq!((v[0].used, v[0].ahead), (2.0, 1.0));
        assert_eq!((v[1].used, v[1].ahead), (4.0, 1.0));
        // ...then the ten-second one: five in it until the first two fall out at 10 s.
        assert_eq!(
            logs.earliest(&ws, 1.0, 2.5 * S, 2.5 * S),
            10.0 * S + EDGE_US
        );
        // A reload keeping the ten-second window keeps its log.
        let only = Windows::new(&[ws.as_slice()[1]]).unwrap();
        assert_eq!(
            logs.earliest(&only, 1.0, 2.5 * S, 2.5 * S),
            10.0 * S + EDGE_US
        );
        assert_eq!(logs.time_to_idle(2.5 * S), 9.5 * S);
    }

    /// The most cost in any interval of `per` (half-open, ending at a start).
    pub(crate) fn worst(starts: &[(f64, f64)], per: f64) -> f64 {
        let mut worst: f64 = 0.0;
        for (i, &(t, _)) in starts.iter().enumerate() {
            let sum: f64 = starts[..=i]
                .iter()
                .filter(|e| e.0 > t - per)
                .map(|e| e.1)
                .sum();
            worst = worst.max(sum);
        }
        worst
    }

    proptest! {
        /// Whatever the arrivals, costs and give-backs, and however far past
        /// `MAX_ENTRIES` the log runs, no interval of `per` holds more than `limit` of
        /// the starts that stay, and a start is never later than needed while the log
        /// is exact.
        #[test]
        fn never_overdrawn(
            limit in 1u32..60,
            per_ms in 1u32..5000,
            steps in proptest::collection::vec((0u32..400_000, 1u32..6, 0u8..4), 1..300),
        ) {
            let limit = f64::from(limit);
            let per = f64::from(per_ms) * 1000.0;
            let mut l = Log { per_us: per, entries: Vec::new() };
            let mut now = 0.0;
            let mut starts: Vec<(f64, f64)> = Vec::new();
            for (gap, cost, op) in steps {
                now += f64::from(gap);
                let cost = f64::from(cost).min(limit);
                if op == 0 {
                    // The latest start still ahead is given back.
                    if let Some(i) = starts.iter().rposition(|s| s.0 > now) {
                        let (at, c) = starts.remove(i);
                        l.unrecord(at, c);
                    }
                    continue;
                }
                l.prune(now);
                let t = l.earliest(limit, cost, now);
                l.record(t, cost);
                starts.push((t, cost));
                starts.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            let w = worst(&starts, per);
            prop_assert!(w <= limit, "{w} in an interval of {per} µs against {limit}");
        }
    }
}
