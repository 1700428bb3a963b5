//! The application state every other room depends on, and nothing here depends on them:
//! [`App`] (built once at start-up, lives until exit) and [`Runtime`] (what a live
//! reload may change, swapped atomically as one `Arc`).
//!
//! The split is typed: anything in [`App`] outside `runtime` needs a restart (listeners,
//! store, upstream pool settings, interception), and [`crate::app::reload`] says which of
//! those a reloaded file tried to change.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::auth::{Users, UsersFileError};
use crate::config::{Config, Policy};
use crate::conn::Lifecycle;
use crate::decision::Sampler;
use crate::endpoint::Resolver;
use crate::forward::Forwarder;
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::tls::Interceptor;

/// What may change on a live reload, swapped as one `Arc`.
pub struct Runtime {
    /// The validated config in force.
    pub config: Arc<Config>,
    /// Endpoint resolution compiled from it.
    pub resolver: Resolver,
    /// Proxy users and their grants, when `security.auth_users_file` is set.
    pub users: Option<Users>,
    /// The bearer token `/metrics` and `/endpoints` need, when `proxy.admin_token_file`
    /// is set.
    pub admin_token: Option<String>,
}

/// Why the files a config names cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The users file is missing or invalid.
    #[error(transparent)]
    Users(#[from] UsersFileError),
    /// The admin token file is missing, unreadable or empty.
    #[error("proxy.admin_token_file {path}: {why}")]
    AdminToken {
        /// The path.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

impl Runtime {
    /// Compiles a config and reads the files it names (users, admin token).
    pub fn load(config: Arc<Config>) -> Result<Runtime, RuntimeError> {
        let users = match &config.security.auth_users_file {
            Some(path) => Some(Users::load(path, &config.security.user_endpoints)?),
            None => None,
        };
        for user in users.iter().flat_map(|u| u.unlisted_grants()) {
            tracing::warn!(
                user,
                "security.user_endpoints grants endpoints to {user:?}, whom the users file does \
                 not list: a misspelt name leaves the real user free to spend any endpoint"
            );
        }
        let admin_token = match &config.proxy.admin_token_file {
            Some(path) => Some(read_token(path)?),
            None => None,
        };
        Ok(Runtime {
            resolver: Resolver::new(&config),
            users,
            admin_token,
            config,
        })
    }
}

fn read_token(path: &Path) -> Result<String, RuntimeError> {
    let fail = |why: String| RuntimeError::AdminToken {
        path: path.to_owned(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(fail("the file is empty".into()));
    }
    Ok(token.to_owned())
}

/// Everything a request needs, built once at start-up.
pub struct App {
    /// Reloadable rules.
    pub runtime: ArcSwap<Runtime>,
    /// Admission over the bucket store.
    pub limiter: Limiter,
    /// The upstream client.
    pub forwarder: Forwarder,
    /// Instruments.
    pub metrics: Arc<Metrics>,
    /// TLS interception, when `tls.intercept = true`.
    pub interceptor: Option<Arc<Interceptor>>,
    /// Connection tracking and shutdown signal.
    pub lifecycle: Lifecycle,
    /// Sampling of the decision log.
    pub sampler: Sampler,
    /// The span exporter (`[traces]`; off by default).
    pub traces: Arc<crate::traces::Traces>,
    /// Upstream connections the plain lane left idle when their sender went.
    pub(crate) idle: crate::upstream::IdleUpstreams,
    /// Bumped after every reload swapped `runtime` in: what outlives one request (a
    /// passthrough tunnel) checks again then whether its sender is still admitted.
    pub(crate) reloads: tokio::sync::watch::Sender<()>,
}

impl App {
    /// The policy of an endpoint ID as the current config sees it (for views).
    pub fn policy_of(&self, id: &str) -> Arc<Policy> {
        self.runtime.load().resolver.policy_of(id)
    }
}
