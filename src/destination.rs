//! Destination policy: which hosts and addresses sluice may connect to.
//!
//! Names are checked against `allowed_hosts`; addresses are checked *after* DNS
//! resolution (a name can resolve to 127.0.0.1 or 169.254.169.254), and the connection
//! is made to exactly the addresses that passed, so a DNS answer cannot change between
//! check and use.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::config::{HostGlobs, SecurityConfig};

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

/// Why a request target's host is not a host name or address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid destination host: {0}")]
pub struct BadHost(pub &'static str);

/// The longest host name DNS can carry (RFC 1035), without the trailing dot.
const MAX_NAME: usize = 253;
/// The longest DNS label.
const MAX_LABEL: usize = 63;

/// The canonical form of a request target's host: lowercase, one trailing dot removed,
/// IPv6 without brackets, an IPv4 address in dotted decimal however it was spelled.
/// Refuses anything that is not a DNS name (≤ 253 characters, labels of 1–63 letters,
/// digits, `-` or `_`) or an IP address, so such hosts never reach endpoint rules,
/// metric labels or DNS.
///
/// A host whose last label is a number is an IPv4 address (as the WHATWG URL standard
/// and every resolver read it: `127.1`, `0x7f.0.0.1`, `0177.0.0.1`, `2130706433` all
/// name 127.0.0.1), or refused when it is not one: each spelling would otherwise be an
/// endpoint and bucket of its own, and miss the `hosts` rules written for the address.
pub fn normalise_host(raw: &str) -> Result<String, BadHost> {
    if let Some(inner) = raw.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or(BadHost("unclosed '['"))?;
        let ip: Ipv6Addr = inner.parse().map_err(|_| BadHost("not an IPv6 address"))?;
        return Ok(ipv6_text(ip));
    }
    // Only an IPv6 address has a colon (a name with one is refused below): names and
    // IPv4 addresses skip the IPv6 parser, on every request.
    if raw.as_bytes().contains(&b':') {
        if let Ok(ip) = raw.parse::<Ipv6Addr>() {
            return Ok(ipv6_text(ip));
        }
    }
    let name = raw.strip_suffix('.').unwrap_or(raw);
    if name.is_empty() {
        return Err(BadHost("empty"));
    }
    if name.len() > MAX_NAME {
        return Err(BadHost("longer than 253 characters"));
    }
    // One pass over the bytes, label by label.
    let mut label = 0usize;
    for &b in name.as_bytes() {
        if b == b'.' {
            if label == 0 {
                return Err(BadHost("empty label"));
            }
            label = 0;
        } else if b == b'-' && label == 0 {
            return Err(BadHost("a label starts with '-'"));
        } else if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            label += 1;
            if label > MAX_LABEL {
                return Err(BadHost("a label is longer than 63 characters"));
            }
        } else {
            return Err(BadHost(
                "only letters, digits, '-', '_' and '.' are allowed",
            ));
        }
    }
    if label == 0 {
        return Err(BadHost("empty label"));
    }
    // A label may not end with '-' either (RFC 1123 §2.1; no certificate can name one).
    if name.ends_with('-') || name.contains("-.") {
        return Err(BadHost("a label ends with '-'"));
    }
    let last = name.rsplit('.').next().unwrap_or(name);
    if last.bytes().all(|b| b.is_ascii_digit()) || ipv4_part(last).is_some() {
        return ipv4_any_form(name)
            .map(|ip| ip.to_string())
            .ok_or(BadHost("ends in a number but is not an IPv4 address"));
    }
    Ok(name.to_ascii_lowercase())
}

/// An IPv6 address as text; an IPv4-mapped one (`::ffff:a.b.c.d`) is the IPv4 address
/// it maps, which is where a connection to it goes: one host, one endpoint.
fn ipv6_text(ip: Ipv6Addr) -> String {
    match ip.to_ipv4_mapped() {
        Some(v4) => v4.to_string(),
        None => ip.to_string(),
    }
}

/// One part of an IPv4 address in any form: decimal, octal after a leading `0`, or
/// hexadecimal after `0x` (`0x` alone is 0).
fn ipv4_part(part: &str) -> Option<u64> {
    let (digits, radix) =
        if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (part, 10)
        };
    if digits.is_empty() {
        return (radix == 16).then_some(0);
    }
    // Leading zeros aside, no part of an address has more than 32 bits of digits.
    let digits = digits.trim_start_matches('0');
    if digits.len() > 11 || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(digits, radix).ok()
}

/// An IPv4 address in any of the forms resolvers take (`inet_aton`): one to four
/// parts, the last filling the bytes the others leave.
fn ipv4_any_form(name: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let numbers = parts
        .iter()
        .map(|p| ipv4_part(p))
        .collect::<Option<Vec<u64>>>()?;
    let (last, leading) = numbers.split_last()?;
    if leading.iter().any(|n| *n > 255) || *last >= 1u64 << (8 * (4 - leading.len())) {
        return None;
    }
    let mut ip = *last;
    for (i, n) in leading.iter().enumerate() {
        ip += n << (8 * (3 - i));
    }
    Some(Ipv4Addr::from(ip as u32))
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
/// IPv4-mapped `::ffff:0:0/96`, IPv4-compatible `::/96`, NAT64 `64:ff9b::/96` and
/// `64:ff9b:1::/48`, 6to4 `2002::/16`, and Teredo `2001::/32` (the client address,
/// stored inverted).
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let o = v6.octets();
    let s = v6.segments();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
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

    #[test]
    fn hosts_are_normalised_or_refused() {
        assert_eq!(
            normalise_host("API.Example.com.").unwrap(),
            "api.example.com"
        );
        assert_eq!(normalise_host("[::1]").unwrap(), "::1");
        assert_eq!(normalise_host("10.0.0.1").unwrap(), "10.0.0.1");
        assert_eq!(normalise_host("my_host-1").unwrap(), "my_host-1");
        assert_eq!(normalise_host("2001:DB8::1").unwrap(), "2001:db8::1");
        // Every spelling of an IPv4 address is that address.
        for spelling in [
            "127.0.0.1",
            "127.0.0.1.",
            "127.1",
            "127.0.1",
            "0x7f.0.0.1",
            "0X7F.0.0.1",
            "0177.0.0.1",
            "127.000.000.001",
            "2130706433",
            "0x7f000001",
            "017700000001",
            "0x7f.1",
            // (2026-12-07) IPv4-mapped IPv6, bracketed as in a URL or bare.
            "[::ffff:127.0.0.1]",
            "[::FFFF:7f00:1]",
            "[0:0:0:0:0:ffff:127.0.0.1]",
            "::ffff:127.0.0.1",
        ] {
            assert_eq!(normalise_host(spelling).unwrap(), "127.0.0.1", "{spelling}");
        }
        assert_eq!(normalise_host("0x").unwrap(), "0.0.0.0");
        assert_eq!(normalise_host("4294967295").unwrap(), "255.255.255.255");
        // Names stay names when their last label is not a number.
        assert_eq!(normalise_host("1.2.3.com").unwrap(), "1.2.3.com");
        assert_eq!(normalise_host("a.0x1g").unwrap(), "a.0x1g");
        assert_eq!(normalise_host("123abc").unwrap(), "123abc");
        for bad in [
            "1.2.3.256",
            "1.2.3.4.5",
            "256.1.2.3",
            "1.2.3.09",
            "4294967296",
            "1.2.65536",
            "example.123",
            "a.b.0x10",
            "00000000000000000000000000000000001.2.3.4.5",
        ] {
            assert!(normalise_host(bad).is_err(), "{bad:?} must be refused");
        }
        // Other IPv6 forms stay IPv6 (they are other addresses).
        assert_eq!(normalise_host("[::127.0.0.1]").unwrap(), "::7f00:1");
        assert_eq!(
            normalise_host("[64:ff9b::7f00:1]").unwrap(),
            "64:ff9b::7f00:1"
        );
        for bad in [
            "-lead.example.com",
            "trail-.example.com",
            "a.-b",
            "a-",
            "",
            ".",
            "a..b",
            "a.b..",
            "exa mple.com",
            "ex%61mple.com",
            "[::1",
            "[nope]",
            "a@b.com",
            "a:b",
            "a.com:80",
            ".a.com",
        ] {
            assert!(normalise_host(bad).is_err(), "{bad:?} must be refused");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(normalise_host(&long_label).is_err());
        let long_name = vec!["a".repeat(60); 5].join(".");
        assert!(long_name.len() > 253 && normalise_host(&long_name).is_err());
        assert!(normalise_host(&"a.".repeat(126)).is_ok()); // 251 characters + dot
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
