//! sluice's own request headers that name more than the endpoint: read by both engines
//! and by the metrics, removed before forwarding.

use http::HeaderName;

/// Names the sender for fair shares when proxy authentication does not (removed before
/// forwarding).
pub const SENDER_HEADER: HeaderName = HeaderName::from_static("x-sluice-sender");
/// `high`, `normal` (default) or `low`: the order of waiting requests (removed before
/// forwarding).
pub const PRIORITY_HEADER: HeaderName = HeaderName::from_static("x-sluice-priority");
