//! A held in-flight slot ([`Slot`]) and the response body that holds it ([`HeldBody`]).
//!
//! A slot is a lease in the store: renewed every third of its ttl while the request
//! runs, given back when the response body ends or is dropped (or the tunnel closes).
//! If the process dies, the renewals stop and the lease expires on its own.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus_client::metrics::gauge::Gauge;

use super::bucket::Ask;
use super::lease::LeaseAsk;
use super::queue::Gates;
use super::{BucketStore, from_micros};

/// One in-flight slot held by this replica; dropping it gives the lease back.
pub struct Slot {
    store: Arc<dyn BucketStore>,
    gates: Arc<Gates>,
    endpoint: Arc<str>,
    ask: Ask,
    lease: LeaseAsk,
    renewer: Option<tokio::task::AbortHandle>,
    gauge: Option<Gauge>,
}

impl Slot {
    /// A slot just leased in the store; starts renewing it.
    pub(super) fn new(
        store: Arc<dyn BucketStore>,
        gates: Arc<Gates>,
        endpoint: Arc<str>,
        ask: Ask,
        lease: LeaseAsk,
    ) -> Slot {
        gates.slot_taken(&endpoint);
        let renewer = tokio::runtime::Handle::try_current().ok().map(|h| {
            let (store, endpoint) = (Arc::clone(&store), Arc::clone(&endpoint));
            h.spawn(renew(store, endpoint, ask, lease)).abort_handle()
        });
        Slot {
            store,
            gates,
            endpoint,
            ask,
            lease,
            renewer,
            gauge: None,
        }
    }

    /// Counts this slot in `gauge` (`sluice_in_flight`) until it is released.
    pub fn track(&mut self, gauge: Gauge) {
        gauge.inc();
        self.gauge = Some(gauge);
    }
}

/// Renews a lease every third of its ttl, for as long as the request runs.
async fn renew(store: Arc<dyn BucketStore>, endpoint: Arc<str>, ask: Ask, lease: LeaseAsk) {
    let every = from_micros(lease.ttl_us / 3.0);
    loop {
        tokio::time::sleep(every).await;
        match store.renew_lease(&endpoint, ask, lease).await {
            Ok(true) => {}
            Ok(false) => {
                // Expired, evicted or lost with the store's state while its request
                // still runs: counted again, or every renewal would find it gone and
                // the endpoint see one more request than max_in_flight until it ends.
                tracing::warn!(
                    endpoint = %endpoint,
                    "an in-flight lease was gone from the store before it was renewed: counted again; until then the endpoint could see one more request than max_in_flight"
                );
                if let Err(e) = store.adopt_lease(&endpoint, ask, lease).await {
                    tracing::debug!(endpoint = %endpoint, error = %e, "could not count a lease again");
                }
            }
            Err(e) => tracing::debug!(endpoint = %endpoint, error = %e, "could not renew a lease"),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        if let Some(g) = self.gauge.take() {
            g.dec();
        }
        let (store, gates) = (Arc::clone(&self.store), Arc::clone(&self.gates));
        let endpoint = Arc::clone(&self.endpoint);
        let (ask, id) = (self.ask, self.lease.id);
        let release = async move {
            if let Err(e) = store.release_lease(&endpoint, ask, id).await {
                tracing::debug!(endpoint = %endpoint, error = %e, "could not release a lease; it expires on its own");
            }
            // Only now: the head this wakes must find the slot free in the store.
            gates.slot_released(&endpoint);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn(release)),
            Err(_) => self.gates.slot_released(&self.endpoint),
        }
    }
}

/// The upstream's response body, holding the request's slot (if any) until the body
/// ends or fails. The slot follows the receiver, not the sender:
/// - a sender that drops the body before its end (an HTTP/2 stream reset after the
///   response head) does not free the slot while the receiver may still be at work: the
///   rest of the body is read and thrown away on a task of its own, which holds the slot
///   until the body ends or no byte came for `drain_limit` (otherwise streams reset
///   after their heads would put more requests at a receiver than `max_in_flight`);
/// - a sender that stops taking the body for `stall_limit` (`idle_timeout`) while the
///   receiver has more to send (an HTTP/2 stream whose window stays shut, its
///   connection kept busy with PINGs) has the body taken from it: drained the same way,
///   the stream then fails, so such a sender cannot hold its slot for as long as it likes.
pub struct HeldBody {
    /// A body without a slot: read in place.
    plain: Option<Incoming>,
    /// A body with a slot, shared with its watchdog.
    held: Option<Arc<Held>>,
    /// The body ended (and its slot went).
    ended: bool,
    drain_limit: Duration,
    /// Shown each data frame the sender takes, then `None` at the end ([`HeldBody::teed`]).
    tee: Option<Tee>,
}

/// What watches a body pass on to its sender ([`HeldBody::teed`]): each data frame, then
/// `None` once when the body ends (or is dropped).
pub type Tee = Box<dyn FnMut(Option<&[u8]>) + Send + Sync>;

/// Why a [`HeldBody`] failed.
type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A slot-holding body and when its sender last took a frame of it.
struct Held {
    /// The body and its slot, until it ends or is taken from a stalled sender.
    body: Mutex<Option<(Incoming, Slot)>>,
    /// When the sender last took a frame (after which the next move is the sender's).
    took: Mutex<Option<Instant>>,
    /// Told when the body ended or was dropped: its watchdog stops at once.
    gone: tokio::sync::Notify,
}

impl HeldBody {
    /// `inner`, holding `slot` until it ends; dropped early or left untaken for
    /// `stall_limit`, it is read to its end for at most `drain_limit` of silence before
    /// the slot goes.
    pub fn new(
        inner: Incoming,
        slot: Option<Slot>,
        drain_limit: Duration,
        stall_limit: Duration,
    ) -> HeldBody {
        let Some(slot) = slot.filter(|_| !inner.is_end_stream()) else {
            return HeldBody {
                plain: Some(inner),
                held: None,
                ended: false,
                drain_limit,
                tee: None,
            };
        };
        let held = Arc::new(Held {
            body: Mutex::new(Some((inner, slot))),
            took: Mutex::new(None),
            gone: tokio::sync::Notify::new(),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(watch_stall(Arc::clone(&held), stall_limit, drain_limit));
        }
        HeldBody {
            plain: None,
            held: Some(held),
            ended: false,
            drain_limit,
            tee: None,
        }
    }

    /// The same body, showing what passes on to the sender to `tee` (a throttling
    /// answer's wait read from its body: `adapt::BodyHint`). The frames pass unchanged.
    pub fn teed(mut self, tee: Option<Tee>) -> HeldBody {
        self.tee = tee;
        self
    }

    fn poll_teed(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = self.poll_inner(cx);
        if let Some(tee) = self.tee.as_mut() {
            match &polled {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        tee(Some(data));
                    }
                }
                Poll::Ready(_) => {
                    tee(None);
                    self.tee = None;
                }
                Poll::Pending => {}
            }
        }
        polled
    }
}

/// Takes the body from a sender that left it untaken for `stall_limit` while the
/// receiver had more to send, and drains it holding the slot.
async fn watch_stall(h: Arc<Held>, stall_limit: Duration, drain_limit: Duration) {
    let every = (stall_limit / 4).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = h.gone.notified() => return,
        }
        let stalled = lock(&h.took).is_some_and(|t| t.elapsed() >= stall_limit);
        if !stalled {
            if lock(&h.body).is_none() {
                return;
            }
            continue;
        }
        let taken = lock(&h.body).take();
        if let Some((inner, slot)) = taken {
            tracing::debug!("a sender left a response untaken: draining it for the receiver");
            drain(inner, slot, drain_limit).await;
        }
        return;
    }
}

/// Reads `inner` to its end (or `limit` of silence), then gives `slot` back.
async fn drain(mut inner: Incoming, slot: Slot, limit: Duration) {
    use http_body_util::BodyExt;
    while let Ok(Some(Ok(_))) = tokio::time::timeout(limit, inner.frame()).await {}
    drop(slot);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The body was taken from a sender that stopped taking it.
#[derive(Debug, thiserror::Error)]
#[error("the sender took none of the response for idle_timeout")]
struct Untaken;

impl Body for HeldBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.get_mut().poll_teed(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.is_inner_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner_size_hint()
    }
}

impl HeldBody {
    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self;
        if let Some(inner) = this.plain.as_mut() {
            return Pin::new(inner).poll_frame(cx).map_err(Into::into);
        }
        let Some(held) = this.held.as_ref().filter(|_| !this.ended) else {
            return Poll::Ready(None);
        };
        let mut body = lock(&held.body);
        let Some((inner, _)) = body.as_mut() else {
            return Poll::Ready(Some(Err(Untaken.into())));
        };
        let polled = Pin::new(inner).poll_frame(cx);
        match &polled {
            // The body ended: the request no longer occupies the receiver.
            Poll::Ready(None | Some(Err(_))) => {
                body.take();
                this.ended = true;
                held.gone.notify_one();
            }
            // A frame taken: the next move is the sender's.
            Poll::Ready(Some(Ok(_))) => *lock(&held.took) = Some(Instant::now()),
            // Waiting on the receiver: no sender's stall.
            Poll::Pending => *lock(&held.took) = None,
        }
        polled.map_err(Into::into)
    }

    fn is_inner_end_stream(&self) -> bool {
        match (&self.plain, &self.held) {
            (Some(inner), _) => inner.is_end_stream(),
            (None, Some(held)) => lock(&held.body)
                .as_ref()
                .is_none_or(|(inner, _)| inner.is_end_stream()),
            (None, None) => true,
        }
    }

    fn inner_size_hint(&self) -> SizeHint {
        match (&self.plain, &self.held) {
            (Some(inner), _) => inner.size_hint(),
            (None, Some(held)) => lock(&held.body)
                .as_ref()
                .map_or_else(|| SizeHint::with_exact(0), |(inner, _)| inner.size_hint()),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        if let Some(mut tee) = self.tee.take() {
            tee(None);
        }
        let Some(held) = self.held.take() else {
            return;
        };
        held.gone.notify_one();
        let Some((inner, slot)) = lock(&held.body).take() else {
            return;
        };
        if inner.is_end_stream() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(drain(inner, slot, self.drain_limit));
        }
    }
}
