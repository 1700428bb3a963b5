//! A request body on its way upstream, watched, and the one rule `upstream_timeout`
//! follows on both HTTP engines (hyper's and the plain lane's).
//!
//! `upstream_timeout` is the longest a forwarded request may go without moving: while
//! its body uploads, the longest neither side moves a byte of it; once the body is all
//! with the upstream, the longest the upstream may take to start its answer. A long
//! upload that keeps moving is never cut, however long after the head left it is still
//! uploading. It must keep
//! moving on average, too: an upload gets `upstream_timeout` plus one second for every
//! [`MIN_UPLOAD_RATE`] bytes it has sent (Apache's `mod_reqtimeout` rule), so a sender
//! trickling a byte just inside the timeout cannot hold a connection and a
//! `max_in_flight` slot for ever. When the request stops moving, the side it waits on
//! is named: a sender that sends none of the rest of its body gets a 408
//! `request_timeout` (its fault, not the receiver's), an upstream that reads none of it
//! or does not answer, a 504 `upstream_timeout`.
//!
//! [`Progress`] is what the body's reader writes (when bytes last moved, whom it waits
//! on) and [`within`] reads when its timer fires; the timer is set once per request and
//! moved only when it fires early, so a body's chunks cost a clock read each, no timer
//! work. [`Upload`] is the hyper engine's request body carrying one.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

/// The average an upload must keep, in bytes per second, past its first
/// `upstream_timeout` (Apache's `mod_reqtimeout` default `MinRate`).
pub const MIN_UPLOAD_RATE: u64 = 500;

/// When a request body last moved, how much of it came, and whether it now waits on its
/// sender.
#[derive(Debug)]
pub struct Progress {
    /// The instant the nanoseconds below count from (when the request was sent).
    base: Instant,
    /// Nanoseconds after `base` at which a byte of the body last moved (or it ended).
    moved: AtomicU64,
    /// Body bytes read from the sender so far.
    received: AtomicU64,
    /// The body is all with the upstream: only the wait for its answer is left.
    done: AtomicBool,
    /// The body waits for bytes from its sender (not for the upstream to take them).
    on_sender: AtomicBool,
}

impl Progress {
    /// A body whose request is sent now.
    pub fn new() -> Progress {
        Progress {
            base: Instant::now(),
            moved: AtomicU64::new(0),
            received: AtomicU64::new(0),
            done: AtomicBool::new(false),
            on_sender: AtomicBool::new(false),
        }
    }

    /// `n` body bytes came from the sender.
    pub fn received(&self, n: u64) {
        self.received.fetch_add(n, Ordering::Relaxed);
        self.moved();
    }

    /// The body is all with the upstream.
    pub fn done(&self) {
        self.done.store(true, Ordering::Relaxed);
        self.moved();
    }

    /// Bytes moved (from the sender, or to the upstream), or the body ended.
    pub fn moved(&self) {
        let since = Instant::now().saturating_duration_since(self.base);
        let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        self.moved.store(nanos, Ordering::Relaxed);
        self.on_sender.store(false, Ordering::Relaxed);
    }

    /// The body waits for its sender (`true`) or for the upstream (`false`).
    pub fn waits_on_sender(&self, yes: bool) {
        self.on_sender.store(yes, Ordering::Relaxed);
    }

    fn last_moved(&self) -> Instant {
        self.base + Duration::from_nanos(self.moved.load(Ordering::Relaxed))
    }
}

impl Default for Progress {
    fn default() -> Progress {
        Progress::new()
    }
}

/// Which side a request that stopped moving waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stalled {
    /// The sender sent none of the rest of its body for `upstream_timeout`, or fell
    /// below [`MIN_UPLOAD_RATE`] on average past it.
    Sender,
    /// The upstream took none of the body, or did not answer, for `upstream_timeout`.
    Upstream,
}

/// Decides, when the request's `timer` fires, whether the request stopped moving: if
/// its body moved since, the timer is set again to `limit` after that, and `None`
/// (not yet); else who it waits on.
pub fn fired(
    timer: Pin<&mut Sleep>,
    progress: Option<&Progress>,
    limit: Duration,
) -> Option<Stalled> {
    let Some(p) = progress else {
        return Some(Stalled::Upstream);
    };
    let mut next = p.last_moved() + limit;
    if !p.done.load(Ordering::Relaxed) {
        // While it uploads: no later than its average allows.
        let earned = p.received.load(Ordering::Relaxed) as f64 / MIN_UPLOAD_RATE as f64;
        let allowed = p.base + limit + Duration::from_secs_f64(earned.min(1e9));
        next = next.min(allowed);
    }
    if next > Instant::now() {
        timer.reset(next);
        return None;
    }
    Some(if p.on_sender.load(Ordering::Relaxed) {
        Stalled::Sender
    } else {
        Stalled::Upstream
    })
}

/// `f`'s output, or who the request waits on once it stopped moving for `limit` (see
/// the module doc). `timer` is set to `limit` after the request was sent.
pub async fn within<F: Future>(
    mut timer: Pin<&mut Sleep>,
    progress: Option<&Progress>,
    limit: Duration,
    f: F,
) -> Result<F::Output, Stalled> {
    let mut f = pin!(f);
    loop {
        tokio::select! {
            biased;
            out = &mut f => return Ok(out),
            () = timer.as_mut() => {}
        }
        if let Some(stalled) = fired(timer.as_mut(), progress, limit) {
            return Err(stalled);
        }
    }
}

/// A request body on its way upstream through hyper's client: the sender's, telling its
/// [`Progress`] (none for a body that is empty from the start), or a copy kept for a
/// resend ([`crate::absorb`]).
pub struct Upload {
    inner: Source,
    progress: Option<Arc<Progress>>,
}

/// Where an [`Upload`]'s bytes come from.
enum Source {
    Sender(Incoming),
    /// A kept body: sent in one frame, then the end.
    Kept(Option<Bytes>),
}

impl Upload {
    /// `inner`, watched unless it is empty.
    pub fn new(inner: Incoming) -> Upload {
        let progress = (!inner.is_end_stream()).then(|| Arc::new(Progress::new()));
        Upload {
            inner: Source::Sender(inner),
            progress,
        }
    }

    /// A body kept whole, sent again.
    pub fn kept(body: Bytes) -> Upload {
        let body = (!body.is_empty()).then_some(body);
        Upload {
            inner: Source::Kept(body),
            progress: None,
        }
    }

    /// Its progress, for [`within`] (none for an empty body).
    pub fn progress(&self) -> Option<Arc<Progress>> {
        self.progress.clone()
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = match &mut this.inner {
            Source::Sender(inner) => Pin::new(inner).poll_frame(cx),
            Source::Kept(body) => return Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
        };
        if let Some(p) = &this.progress {
            match &polled {
                Poll::Pending => p.waits_on_sender(true),
                Poll::Ready(Some(Ok(frame))) => {
                    p.received(frame.data_ref().map_or(0, |d| d.len() as u64));
                }
                Poll::Ready(_) => p.done(),
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Source::Sender(inner) => inner.is_end_stream(),
            Source::Kept(body) => body.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Source::Sender(inner) => inner.size_hint(),
            Source::Kept(body) => SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In virtual time: a body that keeps moving is never cut; one that stops is cut
    /// `limit` after its last move, naming the side it waits on.
    #[tokio::test(start_paused = true)]
    async fn only_a_request_that_stops_moving_times_out() {
        let limit = Duration::from_secs(1);
        let p = Arc::new(Progress::new());
        let started = Instant::now();
        let mover = {
            let p = Arc::clone(&p);
            async move {
                // Three seconds of upload, 1000 bytes every half limit (2000 B/s).
                for _ in 0..6 {
                    p.waits_on_sender(true);
                    tokio::time::sleep(limit / 2).await;
                    p.received(1000);
                }
                // Then the sender goes quiet.
                p.waits_on_sender(true);
                std::future::pending::<()>().await;
            }
        };
        let timer = pin!(tokio::time::sleep(limit));
        let out = within(timer, Some(&p), limit, mover).await;
        assert_eq!(out, Err(Stalled::Sender));
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(4),
            "3 s moving + 1 s still"
        );

        // The body all sent, the upstream silent: its fault, `limit` after the end.
        let p = Progress::new();
        let started = Instant::now();
        let timer = pin!(tokio::time::sleep(limit));
        let quiet = async {
            tokio::time::sleep(limit / 2).await;
            p.done();
            std::future::pending::<()>().await
        };
        let out = within(timer, Some(&p), limit, quiet).await;
        assert_eq!(out, Err(Stalled::Upstream));
        assert_eq!(started.elapsed(), limit + limit / 2);

        // A trickle that keeps inside the silence limit but under the average: cut once
        // `limit` plus a second per 500 bytes received has passed (here 6 bytes: 1.012 s).
        let p = Progress::new();
        let started = Instant::now();
        let timer = pin!(tokio::time::sleep(limit));
        let trickle = async {
            loop {
                p.waits_on_sender(true);
                tokio::time::sleep(limit / 4).await;
                p.received(1);
            }
        };
        let out = within(timer, Some(&p), limit, trickle).await;
        assert_eq!(out, Err(Stalled::Sender));
        let cut = started.elapsed();
        assert!(
            cut >= limit && cut <= limit + limit / 4 + Duration::from_millis(20),
            "cut after {cut:?}"
        );

        // No body: the plain timeout.
        let timer = pin!(tokio::time::sleep(limit));
        let out = within(timer, None, limit, std::future::pending::<()>()).await;
        assert_eq!(out, Err(Stalled::Upstream));
    }
}
