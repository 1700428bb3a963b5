//! A held in-flight slot ([`Slot`]) and the response body that holds it ([`HeldBody`]).
//!
//! A slot is a lease in the store: renewed every third of its ttl while the request
//! runs, given back when the response body ends or is dropped (or the tunnel closes).
//! If the process dies, the renewals stop and the lease expires on its own.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

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
            Ok(false) => tracing::warn!(
                endpoint = %endpoint,
                "an in-flight lease expired before it was renewed: the endpoint may briefly see one more request than max_in_flight"
            ),
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
/// ends or fails. A sender that drops it before its end (an HTTP/2 stream reset after
/// the response head) does not free the slot while the receiver may still be at work:
/// the rest of the body is read and thrown away on a task of its own, which holds the
/// slot until the body ends or no byte came for `drain_limit`. Before, 12 streams reset
/// after their heads had 12 requests at a receiver whose `max_in_flight` was 2.
pub struct HeldBody {
    inner: Option<Incoming>,
    slot: Option<Slot>,
    drain_limit: Duration,
}

impl HeldBody {
    /// `inner`, holding `slot` until it ends; dropped early, it is read to its end for
    /// at most `drain_limit` of silence before the slot goes.
    pub fn new(inner: Incoming, slot: Option<Slot>, drain_limit: Duration) -> HeldBody {
        HeldBody {
            inner: Some(inner),
            slot,
            drain_limit,
        }
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            // The body ended: the request no longer occupies the receiver.
            this.slot.take();
            this.inner.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        let (Some(slot), Some(mut inner)) = (self.slot.take(), self.inner.take()) else {
            return;
        };
        if inner.is_end_stream() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let limit = self.drain_limit;
        rt.spawn(async move {
            use http_body_util::BodyExt;
            // Until the body ends, fails, or goes silent for `limit`.
            while let Ok(Some(Ok(_))) = tokio::time::timeout(limit, inner.frame()).await {}
            drop(slot);
        });
    }
}
