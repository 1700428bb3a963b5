//! Idle upstream connections that outlived their sender connection: the plain lane
//! ([`crate::lane`]) holds one upstream connection per sender connection, and when the
//! sender goes, a clean one waits here for the next sender connection to the same
//! destination, as hyper's pool did for every connection before the lane.
//!
//! Connections are kept per worker thread: a socket belongs to the I/O driver of the
//! worker that opened it, and one served from another thread would wake that thread
//! for every byte. The lock is taken once per sender connection that opens or leaves
//! an upstream connection, never per request.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::Duration;

use tokio::time::Instant;

/// How long an idle connection is kept (hyper-util's pool default).
pub const IDLE_FOR: Duration = Duration::from_secs(90);

/// Most idle connections kept per destination and thread.
pub const PER_KEY: usize = 32;

/// Most idle connections kept in all (a sender cycling through many destinations
/// cannot pile up sockets): past it, a connection leaving is closed.
pub const MAX_KEPT: usize = 4096;

/// Idle connections of type `T` by destination key `K` and thread.
pub struct Idle<K, T> {
    inner: Mutex<Shelves<K, T>>,
}

struct Shelves<K, T> {
    by_key: HashMap<(ThreadId, K), Vec<(Instant, T)>>,
    /// Connections on every shelf.
    kept: usize,
    /// When expired connections were last dropped from every shelf.
    swept: Instant,
}

impl<K: Eq + Hash, T> Default for Idle<K, T> {
    fn default() -> Self {
        Idle {
            inner: Mutex::new(Shelves {
                by_key: HashMap::new(),
                kept: 0,
                swept: Instant::now(),
            }),
        }
    }
}

impl<K: Eq + Hash, T> Idle<K, T> {
    /// Keeps `conn` for `key` on this thread; the oldest goes when the shelf is full.
    /// Now and then drops every connection idle longer than [`IDLE_FOR`], so one whose
    /// destination is never asked for again is not kept for ever.
    pub fn put(&self, key: K, conn: T) {
        let now = Instant::now();
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if now.duration_since(s.swept) >= IDLE_FOR / 2 {
            s.sweep(now);
        }
        if s.kept >= MAX_KEPT {
            return;
        }
        let shelves = &mut *s;
        let shelf = shelves
            .by_key
            .entry((std::thread::current().id(), key))
            .or_default();
        if shelf.len() >= PER_KEY {
            shelf.remove(0);
        } else {
            shelves.kept += 1;
        }
        shelf.push((now, conn));
    }

    /// Drops every connection idle longer than [`IDLE_FOR`]: run now and then, so they
    /// go also when no sender comes again.
    pub fn sweep(&self) {
        let now = Instant::now();
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sweep(now);
    }

    /// The most recently kept connection for `key` on this thread that is younger
    /// than [`IDLE_FOR`] and that `usable` accepts; the others looked at are dropped.
    pub fn take(&self, key: K, usable: impl Fn(&T) -> bool) -> Option<T> {
        let now = Instant::now();
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let k = (std::thread::current().id(), key);
        let shelf = s.by_key.get_mut(&k)?;
        let mut found = None;
        let mut gone = 0;
        while let Some((since, conn)) = shelf.pop() {
            gone += 1;
            if now.duration_since(since) < IDLE_FOR && usable(&conn) {
                found = Some(conn);
                break;
            }
        }
        if shelf.is_empty() {
            s.by_key.remove(&k);
        }
        s.kept -= gone;
        found
    }

    /// How many connections are kept, over all threads.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).kept
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K, T> Shelves<K, T> {
    fn sweep(&mut self, now: Instant) {
        self.by_key.retain(|_, shelf| {
            shelf.retain(|(since, _)| now.duration_since(*since) < IDLE_FOR);
            !shelf.is_empty()
        });
        self.kept = self.by_key.values().map(Vec::len).sum();
        self.swept = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The newest usable connection comes back; unusable and expired ones are dropped;
    /// other keys and other threads never see it.
    #[tokio::test(start_paused = true)]
    async fn connections_come_back_newest_first_and_expire() {
        let idle: Idle<&str, u32> = Idle::default();
        idle.put("a", 1);
        idle.put("a", 2);
        idle.put("a", 3);
        assert_eq!(idle.take("b", |_| true), None);
        assert_eq!(idle.take("a", |c| *c != 3), Some(2), "3 unusable, 2 next");
        assert_eq!(idle.len(), 1, "3 was dropped, 1 stays");
        let other = std::thread::scope(|s| s.spawn(|| idle.take("a", |_| true)).join());
        assert_eq!(other.unwrap(), None, "another thread's shelf is its own");
        tokio::time::advance(IDLE_FOR).await;
        assert_eq!(idle.take("a", |_| true), None, "1 expired");
        assert!(idle.is_empty());
    }

    /// A full shelf loses its oldest; a sweep drops what no one asked for again.
    #[tokio::test(start_paused = true)]
    async fn shelves_are_bounded_and_swept() {
        let idle: Idle<u16, usize> = Idle::default();
        for i in 0..PER_KEY + 3 {
            idle.put(1, i);
        }
        assert_eq!(idle.len(), PER_KEY);
        tokio::time::advance(IDLE_FOR).await;
        idle.put(2, 0);
        assert_eq!(idle.len(), 1, "key 1's expired connections were swept");
    }

    /// Expired connections go at a sweep with no sender coming again (were only a later
    /// `put` to drop them, an idle proxy would keep its sockets for ever), and no more
    /// than [`MAX_KEPT`] are kept in all, however many destinations.
    #[tokio::test(start_paused = true)]
    async fn an_idle_shelf_empties_on_its_own_and_is_bounded_in_all() {
        let idle: Idle<usize, usize> = Idle::default();
        for key in 0..MAX_KEPT + 100 {
            idle.put(key, key);
        }
        assert_eq!(idle.len(), MAX_KEPT);
        idle.sweep();
        assert_eq!(idle.len(), MAX_KEPT, "none expired yet");
        tokio::time::advance(IDLE_FOR).await;
        idle.sweep();
        assert!(idle.is_empty());
        idle.put(7, 7);
        assert_eq!(idle.take(7, |_| true), Some(7), "room again");
    }
}
