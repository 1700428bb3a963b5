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
//!
//! The same step first publishes `<key> <pause µs>` on `<prefix>cooldowns:until`, so a
//! replica also knows until when the endpoint cools down ([`CooldownWatch::cooling_until`]):
//! from the notice's arrival plus the pause, never before the cooldown's end on the
//! store's clock. A replica cut off from the store afterwards holds its local bucket
//! back until then ([`super::fallback`]). The bare key stays on its own channel for
//! replicas that read only that one and for Redis users allowed only that one.
//!
//! A subscription can also die without a word (a NAT or firewall dropping the idle
//! flow, a partition, a host gone without a reset): nothing ends the stream then, and
//! it would vouch for waiters until the process restarted, so they would leave during
//! cooldowns they never heard of. So the subscription is pinged every [`PING_EVERY`] through itself: a ping unanswered within
//! [`PING_WITHIN`] ends it (and a new one is made), and it vouches for nobody while its
//! last answer is older than [`STALE_AFTER`].

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
/// How often the subscription is pinged through itself.
pub(crate) const PING_EVERY: Duration = Duration::from_millis(200);
/// A ping unanswered for this long ends the subscription.
const PING_WITHIN: Duration = Duration::from_millis(500);
/// With no ping answered for this long, the subscription vouches for nobody.
pub(crate) const STALE_AFTER: Duration = Duration::from_millis(800);

#[derive(Default)]
struct State {
    /// When the current subscription was confirmed; `None` while there is none.
    subscribed_since: Option<Instant>,
    /// When the last ping answered through it was sent: every notice Redis sent before
    /// that has arrived.
    answered: Option<Instant>,
    /// Bucket key → when its last cooldown notice arrived.
    notices: HashMap<String, Instant>,
    /// Bucket key → the end of its latest cooldown announced with its pause.
    until: HashMap<String, Instant>,
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
            && Self::fresh(&s)
            && s.notices.get(key).is_none_or(|t| *t < since)
    }

    /// Whether the subscription is up now and answered a ping lately (held tokens could
    /// be vouched for).
    pub(crate) fn listening(&self) -> bool {
        let s = self.lock();
        s.subscribed_since.is_some() && Self::fresh(&s)
    }

    /// A ping through the subscription was answered within [`STALE_AFTER`].
    fn fresh(s: &State) -> bool {
        s.answered.is_some_and(|t| t.elapsed() <= STALE_AFTER)
    }

    /// Notes the subscription up (from now) or down.
    pub(super) fn subscribed(&self, up: bool) {
        self.subscribed_at(up.then(Instant::now));
    }

    fn subscribed_at(&self, at: Option<Instant>) {
        let mut s = self.lock();
        s.subscribed_since = at;
        // The subscription's own confirmation is its first answer.
        s.answered = at;
    }

    /// A ping sent at `sent` was answered through the subscription.
    fn alive(&self, sent: Instant) {
        let mut s = self.lock();
        if s.subscribed_since.is_some() {
            s.answered = Some(sent);
        }
    }

    fn notice(&self, key: String) {
        self.notice_at(key, Instant::now());
    }

    /// The end of the latest cooldown of `key` heard announced, when it is still to come.
    pub(crate) fn cooling_until(&self, key: &str) -> Option<Instant> {
        let s = self.lock();
        s.until.get(key).copied().filter(|t| *t > Instant::now())
    }

    /// A cooldown of `key` announced with its pause (`<key> <pause µs>`): it ends no
    /// earlier than `pause` from now. At most [`MAX_NOTICES`] cooldowns are kept; when
    /// that many are still running, a further one is not (the local bucket then does
    /// not know of it during an outage, as before notices carried their end).
    fn cooling(&self, payload: &str) {
        self.cooling_at(payload, Instant::now());
    }

    fn cooling_at(&self, payload: &str, now: Instant) {
        let Some((key, pause)) = payload.rsplit_once(' ') else {
            return;
        };
        let Some(pause) = pause
            .parse::<f64>()
            .ok()
            .filter(|p| p.is_finite() && *p > 0.0)
        else {
            return;
        };
        let end = now + Duration::from_secs_f64(pause.min(1e15) / 1e6);
        let mut s = self.lock();
        if s.until.len() >= MAX_NOTICES && !s.until.contains_key(key) {
            s.until.retain(|_, t| *t > now);
            if s.until.len() >= MAX_NOTICES {
                return;
            }
        }
        let t = s.until.entry(key.to_owned()).or_insert(end);
        *t = (*t).max(end);
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
    let pubsub = client.get_async_pubsub().await?;
    let (mut sink, mut messages) = pubsub.split();
    sink.subscribe(channel).await?;
    // The ends ride on a channel of their own: a Redis user whose ACL names only the
    // bare one still hears the notices, without their ends.
    let until = format!("{channel}:until");
    if let Err(e) = sink.subscribe(&until).await {
        tracing::debug!(error = %e, "no cooldown ends heard: a replica cut off from the store does not know until when a cooldown it heard of runs");
    }
    watch.subscribed(true);
    // Pinged through itself on a task of its own, so notices are read meanwhile.
    let (dead_tx, mut dead) = tokio::sync::oneshot::channel();
    let w = Arc::clone(watch);
    let _pinger = AbortOnDrop(tokio::spawn(async move {
        let mut every = tokio::time::interval(PING_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            let sent = Instant::now();
            let error = match tokio::time::timeout(PING_WITHIN, sink.ping::<redis::Value>()).await {
                Ok(Ok(_)) => {
                    w.alive(sent);
                    continue;
                }
                Ok(Err(e)) => e,
                Err(_) => silent(),
            };
            let _ = dead_tx.send(error);
            return;
        }
    }));
    loop {
        tokio::select! {
            msg = messages.next() => {
                let Some(msg) = msg else { return Ok(()) };
                let Ok(payload) = msg.get_payload::<String>() else { continue };
                // One cooldown, two messages: the key with its pause, then the bare key (counted).
                if msg.get_channel_name() == until {
                    watch.cooling(&payload);
                } else {
                    watch.notice(payload);
                    heard.inc();
                }
            }
            e = &mut dead => return Err(e.unwrap_or_else(|_| silent())),
        }
    }
}

fn silent() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Io,
        "the cooldown subscription did not answer a ping",
    ))
}

/// Aborts its task when dropped (the subscription's pinger ends with it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
    fn a_cooldown_announced_with_its_pause_is_known_until_it_ends() {
        let w = CooldownWatch::default();
        let t0 = Instant::now();
        w.cooling_at("sluice:{a b} 3000000", t0);
        let end = w.cooling_until("sluice:{a b}").expect("cooling");
        assert_eq!(end, t0 + Duration::from_secs(3));
        // A shorter one later does not shorten it; a longer one lengthens it.
        w.cooling_at("sluice:{a b} 1000000", t0 + Duration::from_millis(10));
        assert_eq!(w.cooling_until("sluice:{a b}"), Some(end));
        w.cooling_at("sluice:{a b} 5000000", t0);
        assert_eq!(
            w.cooling_until("sluice:{a b}"),
            Some(t0 + Duration::from_secs(5))
        );
        for bad in [
            "sluice:{x}",
            "sluice:{x} soon",
            "sluice:{x} -5",
            "sluice:{x} 0",
        ] {
            w.cooling_at(bad, t0);
        }
        assert_eq!(w.cooling_until("sluice:{x}"), None);
        // Over: no longer cooling.
        w.cooling_at("sluice:{y} 1", t0 - Duration::from_secs(1));
        assert_eq!(w.cooling_until("sluice:{y}"), None);
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
