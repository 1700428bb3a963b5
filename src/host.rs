//! Hosts and paths as sluice reads them: the one grammar and canonical form every
//! request target's host, every `hosts` rule and every endpoint ID taken from a host go
//! through (so one host is one endpoint, however it is spelled), and the path a
//! `path_prefix` rule is matched against.

use std::borrow::Cow;
use std::net::{Ipv4Addr, Ipv6Addr};

/// `path` as receivers commonly read it, for matching path prefixes: percent-encodings
/// decoded (once), `.` and `..` segments resolved, repeated `/` collapsed (RFC 3986
/// §6.2.2 and what common servers add to it). A path with nothing to normalise (no `%`,
/// `//` or `/.`) is returned as it is, without a copy. Matching only: the request goes
/// upstream as it came, and a rule matches the raw path too (`/api/../x` leaves `/api`
/// only for a receiver that resolves dots).
pub fn path_as_read(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    let plain = !b.contains(&b'%') && !b.windows(2).any(|w| w == b"//" || w == b"/.");
    if plain {
        return Cow::Borrowed(path);
    }
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut decoded = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).and_then(|&c| hex(c)),
            b.get(i + 2).and_then(|&c| hex(c)),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                decoded.push(hi << 4 | lo);
                i += 3;
            }
            (c, _, _) => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    let text = String::from_utf8_lossy(&decoded);
    let mut segments: Vec<&str> = Vec::new();
    for segment in text.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(text.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    let directory = text.ends_with('/') || text.ends_with("/.") || text.ends_with("/..");
    if out.is_empty() || directory {
        out.push('/');
    }
    Cow::Owned(out)
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

#[cfg(test)]
mod tests {
    use super::*;

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
            // IPv4-mapped IPv6, bracketed as in a URL or bare.
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
}
