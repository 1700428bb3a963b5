//! Destination policy: which hosts and addresses sluice may connect to.
//!
//! Names are checked against `allowed_hosts`; addresses are checked *after* DNS
//! resolution (a name can resolve to 127.0.0.1 or 169.254.169.254), and the connection
//! is made to exactly the addresses that passed, so a DNS answer cannot change between
//! check and use.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::config::{HostGlobs, SecurityConfig};
pub use crate::host::{BadHost, normalise_host};

/// A refusal by the destination policy.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{host}: {why}")]
pub struct Denied {
    /// The host asked for.
    pub host: String,
    /// Which rule refused it.
    pub why: String,
}

impl From<Denied> for crate::error::ProxyError {
    fn from(d: Denied) -> Self {
        crate::error::ProxyError::DestinationDenied {
            host: d.host,
            why: d.why,
        }
    }
}

/// The compiled `[security]` destination rules.
#[derive(Debug, Clone)]
pub struct DestinationPolicy {
    allow_private: bool,
    allowed_hosts: HostGlobs,
}

impl DestinationPolicy {
    /// From the validated config.
    pub fn new(cfg: &SecurityConfig) -> DestinationPolicy {
        DestinationPolicy {
            allow_private: cfg.allow_private_destinations,
            allowed_hosts: cfg.allowed_hosts.clone(),
        }
    }

    /// True when `other` allows exactly what this policy allows.
    pub fn same_as(&self, other: &DestinationPolicy) -> bool {
        self.allow_private == other.allow_private && self.allowed_hosts == other.allowed_hosts
    }

    /// Name-level check (and address check for IP literals), before any token is spent.
    pub fn check_host(&self, host: &str) -> Result<(), Denied> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if !self.allowed_hosts.is_empty() && !self.allowed_hosts.matches(bare) {
            return Err(Denied {
                host: bare.to_owned(),
                why: "not in security.allowed_hosts".into(),
            });
        }
        // With private destinations allowed, an address passes whatever it is: no
        // parse on every request.
        if !self.allow_private {
            if let Ok(ip) = bare.parse::<IpAddr>() {
                self.check_ip(bare, ip)?;
            }
        }
        Ok(())
    }

    /// Address-level check of one resolved address.
    pub fn check_ip(&self, host: &str, ip: IpAddr) -> Result<(), Denied> {
        if !self.allow_private && is_private(ip) {
            return Err(Denied {
                host: host.to_owned(),
                why: format!(
                    "resolves to non-public address {ip} (set security.allow_private_destinations = true to allow)"
                ),
            });
        }
        Ok(())
    }

    /// Resolves `host:port` and keeps only the addresses the policy allows; an error when
    /// none remain or the name does not resolve.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare, port))
            .await
            .map_err(|e| ResolveError::Dns(format!("cannot resolve {bare}: {e}")))?
            .collect();
        let mut denied = None;
        let allowed: Vec<SocketAddr> = addrs
            .into_iter()
            .filter(|a| match self.check_ip(bare, a.ip()) {
                Ok(()) => true,
                Err(d) => {
                    denied = Some(d);
                    false
                }
            })
            .collect();
        match (allowed.is_empty(), denied) {
            (false, _) => Ok(allowed),
            (true, Some(d)) => Err(ResolveError::Denied(d)),
            (true, None) => Err(ResolveError::Dns(format!("{bare} has no addresses"))),
        }
    }
}

/// Why resolving a destination failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    /// The policy refused every address.
    #[error("destination denied: {0}")]
    Denied(Denied),
    /// DNS failed.
    #[error("{0}")]
    Dns(String),
}

/// Loopback, private, link-local, CGNAT, unspecified, multicast, and their IPv6 forms,
/// including IPv6 addresses that carry an IPv4 address (classified by that address).
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => private_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return private_v4(v4);
            }
            let seg0 = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (seg0 & 0xfe00) == 0xfc00 // unique local fc00::/7
                || (seg0 & 0xffc0) == 0xfe80 // link-local fe80::/10
                || (seg0 & 0xffc0) == 0xfec0 // site-local (deprecated)
                || v6 == Ipv6Addr::from([0, 0, 0, 0, 0, 0, 0, 1])
        }
    }
}

/// The IPv4 address an IPv6 address stands for, in the forms routers translate:
/// IPv4-mapped `::ffff:0:0/96`, SIIT's IPv4-translated `::ffff:0:0:0/96` (RFC 7915),
/// IPv4-compatible `::/96`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16`,
/// and Teredo `2001::/32` (the client address, stored inverted).
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let o = v6.octets();
    let s = v6.segments();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return Some(tail); // IPv4-translated (SIIT)
    }
    if s[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
        return Some(tail); // IPv4-compatible (deprecated)
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1) {
        return Some(tail); // NAT64
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5])); // 6to4
    }
    if s[0] == 0x2001 && s[1] == 0 {
        return Some(Ipv4Addr::new(!o[12], !o[13], !o[14], !o[15])); // Teredo client
    }
    None
}

fn private_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || o[0] == 0
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // CGNAT 100.64.0.0/10
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking 198.18.0.0/15
        || o[0] >= 240 // reserved
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn policy(text: &str) -> DestinationPolicy {
        DestinationPolicy::new(&Config::parse(text).unwrap().security)
    }

    #[test]
    fn private_ranges_are_refused_by_default() {
        let p = policy("");
        for h in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "[::1]",
            "::",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "[64:ff9b::7f00:1]",
            "[64:ff9b::a9fe:a9fe]",
            "[64:ff9b:1::a00:1]",
            "[2002:7f00:1::]",
            "[2002:a9fe:a9fe::1]",
            "[::127.0.0.1]",
            "[::10.0.0.1]",
            "[2001:0:4136:e378:8000:63bf:80ff:fffe]", // Teredo client 127.0.0.1
        ] {
            assert!(p.check_host(h).is_err(), "{h} should be refused");
        }
        assert!(p.check_host("93.184.216.34").is_ok());
        assert!(p.check_host("2606:2800:220:1::1").is_ok());
        // Embedded public IPv4 stays allowed.
        assert!(p.check_host("[64:ff9b::5db8:d822]").is_ok());
        assert!(p.check_host("[2002:5db8:d822::1]").is_ok());
    }

    /// SIIT's IPv4-translated addresses (`::ffff:0:0:0/96`, RFC 7915) stand for the IPv4
    /// address in their last 32 bits, like the other embedded forms: a private one is
    /// refused, a public one allowed.
    #[test]
    fn siit_addresses_are_classified_by_their_ipv4() {
        let p = policy("");
        for h in [
            "[::ffff:0:127.0.0.1]",
            "[::ffff:0:7f00:1]",
            "[::ffff:0:10.0.0.1]",
            "[::ffff:0:169.254.169.254]",
            "[::ffff:0:192.168.1.1]",
            "[::ffff:0:0.0.0.0]",
        ] {
            assert!(p.check_host(h).is_err(), "{h} should be refused");
        }
        assert!(p.check_host("[::ffff:0:93.184.216.34]").is_ok());
    }

    #[test]
    fn allow_private_lets_loopback_through() {
        let p = policy("[security]\nallow_private_destinations = true");
        assert!(p.check_host("127.0.0.1").is_ok());
    }

    #[test]
    fn allowed_hosts_globs() {
        let p = policy("[security]\nallowed_hosts = [\"*.example.com\", \"api.test\"]");
        assert!(p.check_host("hooks.example.com").is_ok());
        assert!(p.check_host("HOOKS.Example.com").is_ok());
        assert!(p.check_host("api.test").is_ok());
        assert!(p.check_host("evil.com").is_err());
    }

    #[tokio::test]
    async fn resolution_checks_the_resolved_address() {
        let p = policy("");
        match p.resolve("localhost", 80).await {
            Err(ResolveError::Denied(_)) => {}
            other => panic!("localhost must be denied after resolution: {other:?}"),
        }
    }
}
