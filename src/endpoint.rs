//! Endpoint resolution: which bucket a request draws from.
//!
//! First match wins: the endpoint header; the `Proxy-Authorization` user name when
//! `endpoint_from_proxy_user` is on; the first `[[endpoints]]` rule whose hosts (and
//! path prefix) match the target; the destination host itself under `[defaults]` (or a
//! 403 when `unknown = "reject"`).
//!
//! A host rule written with a port (`hooks.example.com:8443`) matches only requests to
//! that port, the request's effective one: 80 for `http://` without a port, 443 for
//! `https://`, the CONNECT authority's port inside a tunnel. Without a port it matches
//! every port.
//!
//! A path prefix takes a request when it starts the path as sent or as receivers commonly
//! read it ([`path_as_read`]): `/%61pi`, `//api` and `/./api` are `/api` to most
//! servers, and `/api/../x` is still under `/api` to one that routes the raw path.

use std::collections::HashMap;
use std::sync::Arc;

use base64::Engine;
use http::{HeaderMap, HeaderName};

use crate::config::{Config, EndpointRule, Mode, Policy, UnknownEndpoints, check_endpoint_id};
use crate::error::ProxyError;
use crate::host::path_as_read;

/// `X-Sluice-Cost: N`: what a request spends of its endpoint's bucket and of every
/// window, in place of the endpoint's `cost` (removed before forwarding).
pub const COST_HEADER: HeaderName = HeaderName::from_static("x-sluice-cost");

/// The cost a request names (`X-Sluice-Cost`), checked against its endpoint's
/// configured `policy`: `None` when it names none. A value that is not one whole number
/// ≥ 1, or that can never fit the burst or a window's limit, is a bad request (nothing
/// has been spent yet).
pub fn request_cost(headers: &HeaderMap, policy: &Policy) -> Result<Option<u32>, ProxyError> {
    let mut values = headers.get_all(&COST_HEADER).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    let bad = |why: String| ProxyError::BadRequest(format!("{COST_HEADER}: {why}"));
    if values.next().is_some() {
        return Err(bad("given more than once".into()));
    }
    let text = v.to_str().unwrap_or("").trim();
    let cost = match text.parse::<u32>() {
        Ok(n) if n >= 1 && text.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => return Err(bad(format!("{text:?} is not a whole number ≥ 1"))),
    };
    crate::window::cost_fits(f64::from(cost), policy.burst, &policy.windows).map_err(bad)?;
    Ok(Some(cost))
}

/// The endpoint a request belongs to.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The endpoint ID.
    pub id: Arc<str>,
    /// Its policy.
    pub policy: Arc<Policy>,
    /// Enforced or shadow.
    pub mode: Mode,
    /// Named by nothing but its destination host: no endpoint header, proxy user or
    /// `hosts` rule took it (`sluice_host_fallback_total`).
    pub by_host: bool,
}

/// Compiled resolution rules.
#[derive(Debug, Clone)]
pub struct Resolver {
    header: HeaderName,
    from_proxy_user: bool,
    rules: Vec<EndpointRule>,
    by_id: HashMap<Arc<str>, (Arc<Policy>, Mode)>,
    defaults: Arc<Policy>,
    default_mode: Mode,
    unknown: UnknownEndpoints,
    require_endpoint: bool,
}

impl Resolver {
    /// From the validated config.
    pub fn new(cfg: &Config) -> Resolver {
        Resolver {
            header: cfg.proxy.endpoint_header.clone(),
            from_proxy_user: cfg.proxy.endpoint_from_proxy_user,
            by_id: cfg
                .endpoints
                .iter()
                .map(|r| (Arc::clone(&r.id), (Arc::clone(&r.policy), r.mode)))
                .collect(),
            rules: cfg.endpoints.clone(),
            defaults: Arc::clone(&cfg.defaults),
            default_mode: cfg.default_mode,
            unknown: cfg.unknown,
            require_endpoint: cfg.security.require_endpoint,
        }
    }

    /// The header naming the endpoint (removed before forwarding).
    pub fn header(&self) -> &HeaderName {
        &self.header
    }

    /// Whether the proxy user names the endpoint.
    pub fn uses_proxy_user(&self) -> bool {
        self.from_proxy_user
    }

    /// Whether a request to `host` (normalised: lowercase) that names no endpoint by
    /// header or proxy user resolves by its host alone: no rule for that host refines
    /// it by path prefix or by port (a connection may send to one host on two ports).
    pub fn by_host_alone(&self, host: &str) -> bool {
        !self.rules.iter().any(|r| {
            r.hosts
                .iter()
                .any(|h| h.host == host && (r.path_prefix.is_some() || h.port.is_some()))
        })
    }

    /// Configured endpoints with their policies (for `/endpoints`).
    pub fn configured(&self) -> impl Iterator<Item = (&Arc<str>, &Arc<Policy>)> {
        self.rules.iter().map(|r| (&r.id, &r.policy))
    }

    /// The policy an ID gets (configured, or the defaults).
    pub fn policy_of(&self, id: &str) -> Arc<Policy> {
        self.by_id
            .get(id)
            .map(|(p, _)| Arc::clone(p))
            .unwrap_or_else(|| Arc::clone(&self.defaults))
    }

    /// Whether an ID's requests are enforced or shadowed (configured, or the default).
    pub fn mode_of(&self, id: &str) -> Mode {
        self.by_id.get(id).map_or(self.default_mode, |(_, m)| *m)
    }

    /// Resolves a request. `proxy_user` is the user name of the connection's
    /// `Proxy-Authorization` (from this request, or from the CONNECT of its tunnel);
    /// `port` is the target's effective port (the scheme's default when it names none).
    pub fn resolve(
        &self,
        headers: &HeaderMap,
        proxy_user: Option<&str>,
        host: &str,
        port: u16,
        path: &str,
    ) -> Result<Resolved, ProxyError> {
        if let Some(v) = headers.get(&self.header) {
            let id = v.to_str().map_err(|_| {
                ProxyError::BadRequest(format!("{} must be visible ASCII", self.header))
            })?;
            check_endpoint_id(id)
                .map_err(|e| ProxyError::BadRequest(format!("{}: {e}", self.header)))?;
            return self.by_name(id);
        }
        if self.from_proxy_user {
            if let Some(user) = proxy_user.filter(|u| !u.is_empty()) {
                check_endpoint_id(user)
                    .map_err(|e| ProxyError::BadRequest(format!("proxy user name: {e}")))?;
                return self.by_name(user);
            }
        }
        let host = host.to_ascii_lowercase();
        // A rule takes a request when its prefix starts the path as sent or as receivers
        // read it: a receiver may route either.
        let read = path_as_read(path);
        let under = |p: &str| path.starts_with(p) || read.starts_with(p);
        if let Some(rule) = self.rules.iter().find(|r| {
            r.hosts.iter().any(|h| h.matches(&host, port))
                && r.path_prefix.as_deref().is_none_or(under)
        }) {
            return Ok(Resolved {
                id: Arc::clone(&rule.id),
                policy: Arc::clone(&rule.policy),
                mode: rule.mode,
                by_host: false,
            });
        }
        // Nothing named the endpoint: a client that lost its header or proxy user (one
        // that drops a user without a password) lands here, under its destination host.
        if self.require_endpoint {
            return Err(ProxyError::EndpointRequired(host));
        }
        let mut ep = self.by_name(&host)?;
        ep.by_host = true;
        Ok(ep)
    }

    fn by_name(&self, id: &str) -> Result<Resolved, ProxyError> {
        if let Some((k, (p, mode))) = self.by_id.get_key_value(id) {
            return Ok(Resolved {
                id: Arc::clone(k),
                policy: Arc::clone(p),
                mode: *mode,
                by_host: false,
            });
        }
        match self.unknown {
            UnknownEndpoints::Default => Ok(Resolved {
                id: id.into(),
                policy: Arc::clone(&self.defaults),
                mode: self.default_mode,
                by_host: false,
            }),
            UnknownEndpoints::Reject => Err(ProxyError::UnknownEndpoint(id.to_owned())),
        }
    }
}

/// The user name of a `Proxy-Authorization: Basic ...` header, if any.
pub fn proxy_user(headers: &HeaderMap) -> Option<String> {
    let v = headers
        .get(http::header::PROXY_AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, creds) = v.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let user = text.split_once(':').map_or(text.as_str(), |(u, _)| u);
    Some(user.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spellings of a path a receiver reads as `/v1/...` match the
    /// `/v1` rule; before, `/%761/x`, `//v1/x` and `/./v1/x` escaped it to the host's
    /// default bucket. A path that starts with `/v1` as sent stays under it too (the
    /// first version of the fix let `/v1/../x` out).
    #[test]
    fn a_path_prefix_matches_every_spelling_a_receiver_reads_alike() {
        use std::borrow::Cow;
        let r = resolver(RULES);
        let h = HeaderMap::new();
        for path in [
            "/v1/x",
            "/%761/x",
            "//v1/x",
            "/./v1/x",
            "/x/../v1/x",
            "/%2E/v1",
            "///v1",
            // As sent, too: a receiver that routes the raw path reads these under /v1.
            "/v1/../x",
            "/v1/%2e%2e/x",
            "/v1/..%2Fx",
        ] {
            let id = r
                .resolve(&h, None, "hooks.example.com", 443, path)
                .unwrap()
                .id;
            assert_eq!(&*id, "hooks", "{path}");
        }
        for path in ["/v2", "/x/../v2", "/%76%32"] {
            let id = r
                .resolve(&h, None, "hooks.example.com", 443, path)
                .unwrap()
                .id;
            assert_eq!(&*id, "all", "{path}");
        }
        assert!(matches!(path_as_read("/plain/path"), Cow::Borrowed(_)));
        assert_eq!(path_as_read("/a/b/"), "/a/b/");
        assert_eq!(path_as_read("/a/./b/.."), "/a/");
        assert_eq!(path_as_read("/.."), "/");
        assert_eq!(path_as_read("/%zz%4"), "/%zz%4");
    }

    fn resolver(text: &str) -> Resolver {
        Resolver::new(&Config::parse(text).unwrap())
    }

    const RULES: &str = "[[endpoints]]\nid = \"hooks\"\nrate = 5.0\nhosts = [\"hooks.example.com\"]\npath_prefix = \"/v1\"\n\
                         [[endpoints]]\nid = \"all\"\nhosts = [\"hooks.example.com\"]\n\
                         [[endpoints]]\nid = \"ep_42\"\nrate = 100.0\n";

    /// A host resolves by itself unless a rule for it looks at the path; rules for
    /// other hosts do not matter.
    #[test]
    fn a_host_resolves_alone_unless_a_rule_for_it_has_a_path_prefix() {
        let cfg = Config::parse(
            "[[endpoints]]\nid = \"slow\"\nhosts = [\"a.example\"]\npath_prefix = \"/slow\"\n\
             [[endpoints]]\nid = \"b\"\nhosts = [\"b.example\"]\n",
        )
        .unwrap();
        let r = Resolver::new(&cfg);
        assert!(!r.by_host_alone("a.example"));
        assert!(r.by_host_alone("b.example"));
        assert!(r.by_host_alone("c.example"));
    }

    /// A rule with a port takes only requests to that port (the effective one); a rule
    /// without takes every port; a host with a port rule never resolves by host alone
    /// (a connection's last endpoint would otherwise carry over to the other port).
    #[test]
    fn a_host_rule_with_a_port_takes_only_that_port() {
        let r = resolver(
            "[[endpoints]]\nid = \"tls\"\nhosts = [\"hooks.example.com:8443\", \"[::1]:8443\"]\n\
             [[endpoints]]\nid = \"plain\"\nhosts = [\"hooks.example.com:80\"]\n\
             [[endpoints]]\nid = \"rest\"\nhosts = [\"hooks.example.com\"]\n",
        );
        let h = HeaderMap::new();
        let id = |host: &str, port| r.resolve(&h, None, host, port, "/").unwrap().id;
        assert_eq!(&*id("hooks.example.com", 8443), "tls");
        assert_eq!(&*id("HOOKS.example.com", 8443), "tls");
        assert_eq!(&*id("hooks.example.com", 80), "plain");
        assert_eq!(&*id("hooks.example.com", 443), "rest");
        assert_eq!(&*id("hooks.example.com", 9443), "rest");
        assert_eq!(&*id("::1", 8443), "tls");
        assert_eq!(
            &*id("::1", 443),
            "::1",
            "no rule for ::1 on 443: the host's own"
        );
        assert!(!r.by_host_alone("hooks.example.com"));
        assert!(!r.by_host_alone("::1"));
        assert!(r.by_host_alone("other.example"));
        let mut named = HeaderMap::new();
        named.insert("x-endpoint-id", "ep_9".parse().unwrap());
        let ep = r
            .resolve(&named, None, "hooks.example.com", 8443, "/")
            .unwrap();
        assert_eq!(&*ep.id, "ep_9", "the header still wins over a port rule");
    }

    #[test]
    fn header_wins_then_rules_then_host() {
        let r = resolver(RULES);
        let mut h = HeaderMap::new();
        assert_eq!(
            &*r.resolve(&h, None, "hooks.example.com", 443, "/v1/x")
                .unwrap()
                .id,
            "hooks"
        );
        assert_eq!(
            &*r.resolve(&h, None, "HOOKS.example.com", 443, "/v2")
                .unwrap()
                .id,
            "all"
        );
        let other = r.resolve(&h, None, "api.other.com", 443, "/").unwrap();
        assert_eq!(&*other.id, "api.other.com");
        assert_eq!(other.policy.rate, 10.0);
        h.insert("x-endpoint-id", "ep_42".parse().unwrap());
        let ep = r
            .resolve(&h, None, "hooks.example.com", 443, "/v1")
            .unwrap();
        assert_eq!((&*ep.id, ep.policy.rate), ("ep_42", 100.0));
    }

    #[test]
    fn proxy_user_only_when_enabled() {
        let off = resolver(RULES);
        let on = resolver(&format!(
            "[proxy]\nendpoint_from_proxy_user = true\n{RULES}"
        ));
        let h = HeaderMap::new();
        assert_eq!(
            &*off
                .resolve(&h, Some("ep_42"), "x.com", 443, "/")
                .unwrap()
                .id,
            "x.com"
        );
        assert_eq!(
            &*on.resolve(&h, Some("ep_42"), "x.com", 443, "/").unwrap().id,
            "ep_42"
        );
    }

    #[test]
    fn unknown_reject() {
        let r = resolver(&format!("[defaults]\nunknown = \"reject\"\n{RULES}"));
        let mut h = HeaderMap::new();
        assert!(matches!(
            r.resolve(&h, None, "x.com", 443, "/"),
            Err(ProxyError::UnknownEndpoint(_))
        ));
        h.insert("x-endpoint-id", "nope".parse().unwrap());
        assert!(matches!(
            r.resolve(&h, None, "x.com", 443, "/"),
            Err(ProxyError::UnknownEndpoint(_))
        ));
        assert!(
            r.resolve(&HeaderMap::new(), None, "hooks.example.com", 443, "/")
                .is_ok()
        );
    }

    #[test]
    fn bad_header_value_is_bad_request() {
        let r = resolver("");
        let mut h = HeaderMap::new();
        h.insert("x-endpoint-id", "a b".parse().unwrap());
        assert!(matches!(
            r.resolve(&h, None, "x.com", 443, "/"),
            Err(ProxyError::BadRequest(_))
        ));
    }

    #[test]
    fn proxy_user_parsing() {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::PROXY_AUTHORIZATION,
            "Basic ZXBfeDo=".parse().unwrap(),
        ); // "ep_x:"
        assert_eq!(proxy_user(&h).as_deref(), Some("ep_x"));
        h.insert(
            http::header::PROXY_AUTHORIZATION,
            "Basic !!!".parse().unwrap(),
        );
        assert_eq!(proxy_user(&h), None);
    }
}
