//! Coalescing of concurrent acquires of one endpoint into one Redis script call.
//!
//! An endpoint with no acquire in flight sends its acquire at once, alone: an idle
//! endpoint pays nothing extra. While one is in flight, further acquires of that endpoint
//! wait in its *lane*; when the call returns, everything that queued meanwhile goes out
//! as the next call — one `acquire.lua` invocation with one (budget, held) pair per ask,
//! decided in arrival order exactly as back-to-back calls at one instant would be (same
//! refill, same reservations, same refusals). A saturated endpoint thus costs one round
//! trip per batch rather than per request, and keeps its FIFO order: a batch is sent only
//! after the previous call for its endpoint was decided.
//!
//! The first ask of a lane is sent by its own request; the batches after it by a task the
//! lane owns, so a request that hangs up never strands the ones queued behind it. A
//! queued ask whose request hung up before its batch left is not sent; one that hung up
//! while its batch was in flight has its reservation given back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::StoreError;
use super::bucket::{Ask, Outcome};
use super::redis::Calls;

/// At most this many asks go in one script call (the rest in the next).
const MAX_BATCH: usize = 256;

/// One queued ask and where its outcome goes.
struct Waiter {
    ask: Ask,
    reply: oneshot::Sender<Result<Outcome, StoreError>>,
}

/// Every endpoint with an acquire in flight, and what queued behind it. An endpoint is
/// in the map exactly while a call for it is in flight.
#[derive(Default)]
pub(super) struct Lanes(Mutex<HashMap<Box<str>, Vec<Waiter>>>);

impl Lanes {
    fn lock(&self) -> MutexGuard<'_, HashMap<Box<str>, Vec<Waiter>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next batch for `endpoint`, or `None` (and the lane closed) when none queued.
    fn next(&self, endpoint: &str) -> Option<Vec<Waiter>> {
        let mut lanes = self.lock();
        let queue = lanes.get_mut(endpoint)?;
        queue.retain(|w| !w.reply.is_closed());
        if queue.is_empty() {
            lanes.remove(endpoint);
            return None;
        }
        // One call shares one policy: a reload between two asks splits the batch.
        let first = queue[0].ask;
        let n = queue
            .iter()
            .take(MAX_BATCH)
            .take_while(|w| same_policy(&w.ask, &first))
            .count();
        Some(queue.drain(..n).collect())
    }
}

fn same_policy(a: &Ask, b: &Ask) -> bool {
    a.rate == b.rate && a.burst == b.burst && a.recovery_us == b.recovery_us
}

/// Decides `ask` for `endpoint`: alone at once when nothing is in flight for it, else in
/// the next batch.
pub(super) async fn acquire(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    ask: Ask,
) -> Result<Outcome, StoreError> {
    let queued = {
        let mut map = lanes.lock();
        match map.get_mut(endpoint) {
            Some(queue) => {
                let (reply, outcome) = oneshot::channel();
                queue.push(Waiter { ask, reply });
                Some(outcome)
            }
            None => {
                map.insert(endpoint.into(), Vec::new());
                None
            }
        }
    };
    if let Some(outcome) = queued {
        return outcome.await.unwrap_or_else(|_| {
            Err(StoreError::Unreachable(
                "the batch carrying this acquire was dropped".to_owned(),
            ))
        });
    }
    // This request opens the lane: its call goes alone, and whatever queues behind it
    // is handed on when the call ends (or when this request hangs up).
    let _handover = Handover {
        calls,
        lanes,
        endpoint,
    };
    let mut outcomes = calls.acquire(endpoint, &[ask]).await?;
    outcomes
        .pop()
        .ok_or_else(|| StoreError::Protocol("acquire answered no outcome".to_owned()))
}

/// Hands a lane's queue to a task when the call that opened it ends.
struct Handover<'a> {
    calls: &'a Arc<Calls>,
    lanes: &'a Arc<Lanes>,
    endpoint: &'a str,
}

impl Drop for Handover<'_> {
    fn drop(&mut self) {
        let Some(batch) = self.lanes.next(self.endpoint) else {
            return;
        };
        let (calls, lanes) = (Arc::clone(self.calls), Arc::clone(self.lanes));
        let endpoint: Box<str> = self.endpoint.into();
        // Outside a runtime (only at shutdown) the queued asks are dropped, and their
        // requests see the store as unreachable.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(drain(calls, lanes, endpoint, batch));
        }
    }
}

/// Sends batches for `endpoint` until its lane is empty.
async fn drain(calls: Arc<Calls>, lanes: Arc<Lanes>, endpoint: Box<str>, first: Vec<Waiter>) {
    let mut batch = first;
    loop {
        let asks: Vec<Ask> = batch.iter().map(|w| w.ask).collect();
        match calls.acquire(&endpoint, &asks).await {
            Ok(outcomes) if outcomes.len() == batch.len() => {
                for (w, outcome) in batch.into_iter().zip(outcomes) {
                    if w.reply.send(Ok(outcome)).is_err() {
                        give_back(&calls, &endpoint, &w.ask, outcome).await;
                    }
                }
            }
            Ok(_) => {
                let e = StoreError::Protocol("acquire answered a short batch".to_owned());
                fail(batch, &e);
            }
            Err(e) => fail(batch, &e),
        }
        match lanes.next(&endpoint) {
            Some(next) => batch = next,
            None => return,
        }
    }
}

fn fail(batch: Vec<Waiter>, e: &StoreError) {
    for w in batch {
        let _ = w.reply.send(Err(e.clone()));
    }
}

/// A grant whose request hung up while its batch was in flight: give the token back.
async fn give_back(calls: &Calls, endpoint: &str, ask: &Ask, outcome: Outcome) {
    if let Outcome::Granted { generation, .. } = outcome {
        if let Err(e) = calls.release(endpoint, ask, generation).await {
            tracing::debug!(endpoint, error = %e, "could not give back an abandoned reservation");
        }
    }
}
