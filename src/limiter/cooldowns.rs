//! Cooldown notices over Redis pub/sub, so a request that slept for its reservation can
//! leave without a second store call.
//!
//! `feedback.lua` publishes the bucket key on `<prefix>cooldowns` whenever a cooldown
//! starts (the step that voids outstanding reservations). Every replica keeps one
//! subscription ([`follow`]) and notes when each key was last announced. A waiter that
//! wakes asks [`CooldownWatch::quiet_since`] with the instant it sent its reservation: if
//! the subscription has been up since before then and no notice for its key arrived
//! since, no cooldown can have voided it and it goes; otherwise (subscription down or
//! reconnected meanwhile, or a notice arrived) it confirms with the store as before.
//! Redis does not buffer pub/sub messages for a dropped subscriber, hence "up since".

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

/// Keys remembered before the table is cleared (clearing counts as a resubscription, so
/// it can only cause extra confirm calls, never a missed cooldown).
const MAX_NOTICES: usize = 10_000;
/// Pause between subscription attempts while Redis is unreachable.
const RETRY_EVERY: Duration = Duration::from_millis(250);

#[derive(Default)]
struct State {
    /// When the current subscription was confirmed; `None` while there is none.
    subscribed_since: Option<Instant>,
    /// Bucket key → when its last cooldown notice arrived.
    notices: HashMap<String, Instant>,
}

/// What this replica has heard of cooldowns (see the module docs).
#[derive(Default)]
pub(crate) struct CooldownWatch {
    state: Mutex<State>,
}

impl CooldownWatch {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True when no cooldown of `key` can have started since `since`: subscribed all
    /// along and no notice for `key` since.
    pub(crate) fn quiet_since(&self, key: &str, since: Instant) -> bool {
        let s = self.lock();
        s.subscribed_since.is_some_and(|t| t <= since)
            && s.notices.get(key).is_none_or(|t| *t < since)
    }

    /// Whether the subscription is up now (held tokens could be vouched for).
    pub(crate) fn listening(&self) -> bool {
        self.lock().subscribed_since.is_some()
    }

    /// Notes the subscription up (from now) or down.
    pub(super) fn subscribed(&self, up: bool) {
        self.subscribed_at(up.then(Instant::now));
    }

    fn subscribed_at(&self, at: Option<Instant>) {
        self.lock().subscribed_since = at;
    }

    fn notice(&self, key: String) {
        self.notice_at(key, Instant::now());
    }

    fn notice_at(&self, key: String, now: Instant) {
        let mut s = self.lock();
        if s.notices.len() >= MAX_NOTICES {
            s.notices.clear();
            if s.subscribed_since.is_some() {
                s.subscribed_since = Some(now);
            }
        }
        s.notices.insert(key, now);
    }
}

/// Keeps a subscription to `channel` on `client`, feeding `watch`, until the watch is
/// dropped. Reconnects every [`RETRY_EVERY`] while Redis is unreachable.
pub(crate) async fn follow(
    client: redis::Client,
    channel: String,
    watch: Weak<CooldownWatch>,
    heard: Counter,
) {
    loop {
        let Some(w) = watch.upgrade() else { return };
        if let Err(e) = listen(&client, &channel, &w, &heard).await {
            tracing::debug!(error = %e, "cooldown subscription down: waiters confirm with the store");
        }
        w.subscribed(false);
        drop(w);
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

async fn listen(
    client: &redis::Client,
    channel: &str,
    watch: &Arc<CooldownWatch>,
    heard: &Counter,
) -> Result<(), redis::RedisError> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    watch.subscribed(true);
    let mut messages = pubsub.on_message();
    while let Some(msg) = messages.next().await {
        if let Ok(key) = msg.get_payload::<String>() {
            watch.notice(key);
            heard.inc();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_only_when_subscribed_all_along_and_no_notice_since() {
        let w = CooldownWatch::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert!(!w.quiet_since("k", at(0)), "not subscribed: confirm");
        w.subscribed_at(Some(at(10)));
        assert!(
            !w.quiet_since("k", at(5)),
            "subscribed after the reservation"
        );
        assert!(w.quiet_since("k", at(20)));
        w.notice_at("k".into(), at(30));
        assert!(
            !w.quiet_since("k", at(20)),
            "a cooldown was announced meanwhile"
        );
        assert!(
            w.quiet_since("k", at(40)),
            "announced before the reservation"
        );
        assert!(w.quiet_since("other", at(20)));
        w.subscribed_at(None);
        assert!(!w.quiet_since("other", at(20)), "subscription lost");
    }

    #[test]
    fn a_full_table_is_cleared_as_if_resubscribed() {
        let w = CooldownWatch::default();
        let t0 = Instant::now();
        w.subscribed_at(Some(t0));
        for i in 0..MAX_NOTICES {
            w.notice_at(format!("k{i}"), t0);
        }
        w.notice_at("last".into(), t0 + Duration::from_millis(5));
        assert!(!w.quiet_since("k1", t0), "older waiters confirm");
    }
}
