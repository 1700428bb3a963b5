//! The periodic look at every known endpoint: refreshes the rate / at-floor / cooldown /
//! waiting gauges and logs state changes (cooldown ended, floor reached, stuck at the floor).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::admin::{EndpointView, endpoint_views};
use crate::core::App;
use crate::metrics::{EndpointLabels, WindowLabels};

/// Runs until shutdown, looking every `every`.
pub async fn run(app: Arc<App>, every: Duration) {
    let mut stop = app.lifecycle.signal();
    let mut last: HashMap<String, EndpointView> = HashMap::new();
    let mut warned: HashMap<String, bool> = HashMap::new();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Shutdown: stop looking.
            _ = crate::conn::until_down(&mut stop) => return,
        }
        let views = endpoint_views(&app).await;
        let rt = app.runtime.load_full();
        for v in views {
            let id: Arc<str> = v.id.as_str().into();
            let label = EndpointLabels {
                endpoint: app.metrics.label(&id),
            };
            app.metrics.rate.get_or_create(&label).set(v.rate);
            app.metrics
                .at_floor
                .get_or_create(&label)
                .set(i64::from(v.at_floor));
            app.metrics
                .cooldown
                .get_or_create(&label)
                .set(v.cooldown_ms as f64 / 1000.0);
            app.metrics
                .waiting
                .get_or_create(&label)
                .set(i64::try_from(v.waiting).unwrap_or(i64::MAX));
            app.metrics
                .oldest_wait
                .get_or_create(&label)
                .set(v.oldest_wait_ms as f64 / 1000.0);
            for w in &v.windows {
                let labels = WindowLabels {
                    endpoint: label.endpoint.clone(),
                    per: w.per(),
                };
                app.metrics.window_used.get_or_create(&labels).set(w.used);
            }
            if let Some(prev) = last.get(&v.id) {
                if prev.cooldown_ms > 0 && v.cooldown_ms == 0 {
                    tracing::info!(endpoint = %v.id, rate = v.rate, "cooldown ended: sending again at the reduced rate");
                }
                if !prev.at_floor && v.at_floor {
                    tracing::warn!(endpoint = %v.id, rate = v.rate, "rate reached its adaptive floor");
                }
            }
            let warn_after = rt
                .resolver
                .policy_of(&v.id)
                .adaptive
                .map(|a| a.floor_warn_after);
            let stuck =
                warn_after.is_some_and(|w| v.at_floor && v.at_floor_secs >= w.as_secs_f64());
            let was = warned.insert(v.id.clone(), stuck).unwrap_or(false);
            if stuck && !was {
                tracing::warn!(
                    endpoint = %v.id,
                    at_floor_secs = v.at_floor_secs as u64,
                    throttles = v.throttles,
                    "endpoint has stayed at its rate floor: the receiver keeps answering 429 (broken receiver or misfiring WAF?)"
                );
            }
            last.insert(v.id.clone(), v);
        }
    }
}
