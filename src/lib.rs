//! sluice: an HTTP forward proxy that makes webhook senders and API clients keep the
//! rate limits their receivers publish.
//!
//! # Layout
//! - [`core`]: [`core::App`] and the reloadable [`core::Runtime`]: the state every room
//!   depends on; it depends on none of the rooms that serve requests.
//! - [`app`]: wiring: builds the app from a config, binds, runs, reloads.
//! - [`config`]: TOML → validated, typed [`config::Config`]; every rule tested.
//! - [`server`]: the proxy and admin accept loops, their caps, graceful shutdown.
//! - [`fds`]: the descriptor limit against `proxy.max_connections`, raised at start,
//!   and the caps the listeners serve under when it is short.
//! - [`sniff`]: what a CONNECT tunnel carries (TLS, plain HTTP or other bytes), read
//!   from its first bytes.
//! - [`budget`]: the memory ceiling (`proxy.max_memory`) and the overload response near it.
//! - [`conn`]: one connection: serving HTTP/1.1 or HTTP/2, idle timeouts, lifecycle.
//! - [`engine`]: which engine serves a connection (the lane or hyper), and CONNECT
//!   tunnels: interception, plain HTTP inside, relays.
//! - [`lane`]: the plain HTTP/1.1 engine (the default): heads, framing, relay.
//! - [`upstream`]: the lane's kept-alive upstream connections and their reuse checks.
//! - [`proxy`]: one request: target → identify → resolve → destination → label → admit
//!   → forward → observe; the same admission for plain HTTP, CONNECT and intercepted
//!   requests.
//! - [`decision`]: the per-request decision log (one structured line per request).
//! - [`logging`]: where log lines go: a bounded queue and a background writer thread
//!   (stderr or `[log] file`), dropping and counting lines rather than blocking.
//! - [`auth`]: proxy users (htpasswd, bcrypt), the credentials cache, endpoint grants.
//! - [`endpoint`]: endpoint resolution (header, proxy user, host/path rules, defaults).
//! - [`destination`]: destination policy (allowed hosts, private-address refusal).
//! - [`limiter`]: the [`limiter::Limiter`] over the [`limiter::BucketStore`] seam
//!   (memory, Redis, Redis Cluster, Redis Sentinel, fallback); the bucket math lives in
//!   [`limiter::bucket`],
//!   in-flight leases in [`limiter::lease`] and [`limiter::slot`], the per-endpoint
//!   FIFO / weighted fair / priority queue in [`limiter::queue`].
//! - [`absorb`]: which refusals of a receiver sluice absorbs (holds the request behind
//!   the cooldown and sends it again within its wait budget).
//! - [`adapt`]: pure policy turning 429 / Retry-After / RateLimit headers into feedback.
//! - [`learned`]: quotas receivers publish, spread evenly until their reset.
//! - [`forward`]: upstream client (pooled, rustls), hop-by-hop hygiene, CONNECT tunnels.
//! - [`tls`]: the interception CA on disk ([`tls::ca`]), per-host leaves and their
//!   bounded cache ([`tls::leaf`]), TLS termination of intercepted CONNECTs
//!   ([`tls::intercept`]), and the rustls client configuration for upstream connections
//!   ([`tls::upstream`]).
//! - [`metrics`]: Prometheus registry and the instruments sluice exports.
//! - [`traces`]: OpenTelemetry spans of each request, exported over OTLP/HTTP (`[traces]`).
//! - [`observer`]: periodic endpoint look: gauges and state-change logs.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz`, `/endpoints`.
//! - [`demo`]: `sluice demo-receiver`, a tiny receiver (200 / 429 / slow) for trying sluice offline.
//! - [`limits`]: the wire's size limits both engines read.
//! - [`headers`]: sluice's own sender and priority header names.
//! - [`window`]: sliding windows' math (`windows = [{ limit, per }]`), pure functions.
//! - [`error`]: [`error::ProxyError`] and the one place that turns it into a response.
//! - [`version`]: version, git commit and build date stamped by `build.rs`.
#![deny(missing_docs)]

pub mod absorb;
pub mod adapt;
pub mod admin;
pub mod app;
pub mod auth;
pub mod budget;
pub mod config;
pub mod conn;
pub mod core;
pub mod decision;
pub mod demo;
pub mod destination;
pub mod endpoint;
pub mod engine;
pub mod error;
pub mod fds;
pub mod forward;
pub mod headers;
pub mod host;
pub mod idle;
pub mod lane;
pub mod learned;
pub mod limiter;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod observer;
pub mod proxy;
pub mod server;
pub mod sniff;
pub mod tls;
pub mod traces;
pub mod upload;
pub mod upstream;
pub mod version;
pub mod window;
pub mod workers;
