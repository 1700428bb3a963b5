//! A held in-flight slot ([`Slot`]) and the response body that holds it ([`HeldBody`]).
//!
//! A slot is a lease in the store: renewed every third of its ttl while the request
//! runs, given back when the response body ends or is dropped (or the tunnel closes).
//! If the process dies, the renewals stop and the lease expires on its own.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

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

pin_project_lite::pin_project! {
    /// The upstream's response body, holding the request's slot (if any) until the body
    /// ends, fails or is dropped.
    pub struct HeldBody {
        #[pin]
        inner: Incoming,
        slot: Option<Slot>,
    }
}

impl HeldBody {
    /// `inner`, holding `slot` until it ends.
    pub fn new(inner: Incoming, slot: Option<Slot>) -> HeldBody {
        HeldBody { inner, slot }
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            // The body ended: the request no longer occupies the receiver.
            this.slot.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
