//! Per-host leaf certificates and the cache that keeps them.
//!
//! This module owns what a leaf looks like (`mint`: its own fresh key, SAN = the DNS
//! name or IP address, CN = host when it fits, EKU serverAuth, not a CA, short validity),
//! the rustls `ServerConfig` presented with it (`server_config`: chain `[leaf, CA]`,
//! ALPN `h2` + `http/1.1`), and the bounded, least-recently-used `LeafCache` of those
//! configs. It knows nothing of files: the issuer is handed in by [`super::ca`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

/// Longest leaf lifetime accepted (Apple clients reject longer).
pub(super) const MAX_LEAF_VALIDITY: Duration = Duration::from_secs(825 * 24 * 3600);
/// Shortest leaf lifetime accepted.
pub(super) const MIN_LEAF_VALIDITY: Duration = Duration::from_secs(60);
/// Longest common name X.509 allows (ub-common-name); longer hosts get SAN only.
const MAX_COMMON_NAME_LEN: usize = 64;

/// A host a leaf is minted for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Host {
    /// A DNS name, lower-case, without trailing dot.
    Dns(String),
    /// An IP literal.
    Ip(IpAddr),
}

impl Host {
    /// Parses a DNS name or IP literal (IPv6 optionally in brackets).
    pub(super) fn parse(host: &str) -> Result<Self, String> {
        let host = host.trim();
        if let Some(inner) = host.strip_prefix('[') {
            let inner = inner
                .strip_suffix(']')
                .ok_or_else(|| "unbalanced '[' in host".to_owned())?;
            return match inner.parse::<IpAddr>() {
                Ok(ip @ IpAddr::V6(_)) => Ok(Self::Ip(ip)),
                _ => Err("brackets must enclose an IPv6 address".to_owned()),
            };
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok(Self::Ip(ip));
        }
        let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        match ServerName::try_from(name.as_str()) {
            Ok(ServerName::DnsName(_)) => Ok(Self::Dns(name)),
            _ => Err("not a valid DNS name or IP address".to_owned()),
        }
    }

    /// The cache key: the canonical spelling.
    pub(super) fn key(&self) -> String {
        match self {
            Self::Dns(name) => name.clone(),
            Self::Ip(ip) => ip.to_string(),
        }
    }
}

/// Mints a leaf for `host` with its own fresh key, signed by `issuer`: (leaf, leaf key).
///
/// `authority_key_id`: whether the leaf carries an authorityKeyIdentifier (when the CA
/// has a subjectKeyIdentifier to point at).
pub(super) fn mint(
    host: &Host,
    validity: Duration,
    issuer: &Issuer<'_, KeyPair>,
    authority_key_id: bool,
) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), String> {
    let key = KeyPair::generate().map_err(|e| format!("cannot generate a key: {e}"))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    match host {
        Host::Ip(ip) => {
            params.subject_alt_names = vec![SanType::IpAddress(*ip)];
            dn.push(DnType::CommonName, ip.to_string());
        }
        Host::Dns(name) => {
            let san = name
                .as_str()
                .try_into()
                .map_err(|e| format!("not an ASCII host name: {e}"))?;
            params.subject_alt_names = vec![SanType::DnsName(san)];
            if name.len() <= MAX_COMMON_NAME_LEN {
                dn.push(DnType::CommonName, name.as_str());
            }
        }
    }
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = authority_key_id;
    super::set_validity(&mut params, validity)?;
    let leaf = params
        .signed_by(&key, issuer)
        .map_err(|e| format!("cannot sign the certificate: {e}"))?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    Ok((leaf.der().clone(), key_der))
}

/// The rustls config presenting `chain` (leaf first) with `key`; ALPN `h2`, `http/1.1`
/// (the sender chooses).
pub(super) fn server_config(
    provider: Arc<CryptoProvider>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
        .map_err(|e| format!("rustls rejected the certificate: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    // Sluice's suite order (AES-128-GCM first, `super::crypto_provider`) over the
    // sender's: rustls offers only suites it holds secure, and this one costs the
    // handshake least (a SHA-256 key schedule).
    config.ignore_client_order = true;
    Ok(config)
}

/// Host key → value (a `ServerConfig` in production), bounded, least recently used
/// evicted first; an entry past its refresh time counts as absent.
///
/// `Send + Sync`: one mutex guards the map; minting happens outside it.
pub(super) struct LeafCache<V> {
    capacity: usize,
    slots: Mutex<Slots<V>>,
}

/// The guarded state of a [`LeafCache`].
struct Slots<V> {
    entries: HashMap<String, Entry<V>>,
    /// Logical clock for recency.
    tick: u64,
}

/// One cached value.
struct Entry<V> {
    value: V,
    /// When the value is due to be replaced (for leaves: a quarter of the validity left).
    refresh_at: Instant,
    last_used: u64,
}

impl<V: Clone> LeafCache<V> {
    /// An empty cache holding at most `capacity` hosts (at least 1).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            slots: Mutex::new(Slots {
                entries: HashMap::new(),
                tick: 0,
            }),
        }
    }

    /// Most hosts kept.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of hosts currently cached.
    pub(super) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    fn lock(&self) -> MutexGuard<'_, Slots<V>> {
        // Every critical section leaves the map consistent, so a poisoned lock is usable.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached, still fresh value for `key`, marking it used.
    pub(super) fn get(&self, key: &str) -> Option<V> {
        let mut slots = self.lock();
        slots.tick += 1;
        let tick = slots.tick;
        let entry = slots.entries.get_mut(key)?;
        if Instant::now() >= entry.refresh_at {
            return None;
        }
        entry.last_used = tick;
        Some(entry.value.clone())
    }

    /// Caches `value` for `key` (evicting the least recently used host if full), unless a
    /// fresh value was cached meanwhile, which is returned instead.
    pub(super) fn insert(&self, key: String, value: V, refresh_at: Instant) -> V {
        let mut slots = self.lock();
        slots.tick += 1;
        let tick = slots.tick;
        if let Some(entry) = slots.entries.get_mut(&key) {
            if Instant::now() < entry.refresh_at {
                entry.last_used = tick;
                return entry.value.clone();
            }
        } else if slots.entries.len() >= self.capacity {
            let oldest = slots
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                slots.entries.remove(&oldest);
            }
        }
        slots.entries.insert(
            key,
            Entry {
                value: value.clone(),
                refresh_at,
                last_used: tick,
            },
        );
        value
    }

    /// Makes the entry for `key` due for refresh now.
    #[cfg(test)]
    pub(super) fn expire(&self, key: &str) {
        if let Some(entry) = self.lock().entries.get_mut(key) {
            entry.refresh_at = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_parsing() {
        assert_eq!(
            Host::parse("Api.Example.COM.").unwrap(),
            Host::Dns("api.example.com".into())
        );
        assert_eq!(
            Host::parse("[::1]").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        assert_eq!(
            Host::parse("::1").unwrap(),
            Host::Ip("::1".parse().unwrap())
        );
        assert_eq!(
            Host::parse("127.0.0.1").unwrap(),
            Host::Ip("127.0.0.1".parse().unwrap())
        );
        for bad in [
            "",
            "[127.0.0.1]",
            "[::1",
            "exa mple.com",
            "host:443",
            "ünïcode.example",
        ] {
            assert!(Host::parse(bad).is_err(), "{bad:?} should be rejected");
        }
        assert_eq!(Host::parse("[::1]").unwrap().key(), "::1");
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[test]
    fn cache_is_bounded_and_evicts_least_recently_used() {
        let cache = LeafCache::new(2);
        cache.insert("a".into(), Arc::new(1), later());
        cache.insert("b".into(), Arc::new(2), later());
        // Touch a, so b is the least recently used.
        assert_eq!(cache.get("a").as_deref(), Some(&1));
        cache.insert("c".into(), Arc::new(3), later());
        assert_eq!(cache.len(), 2);
        assert!(cache.get("b").is_none());
        assert_eq!(cache.get("a").as_deref(), Some(&1));
        assert_eq!(LeafCache::<u8>::new(0).capacity(), 1);
    }

    #[test]
    fn fresh_entries_win_races_and_stale_ones_are_replaced() {
        let cache = LeafCache::new(4);
        let first = cache.insert("a".into(), Arc::new(1), later());
        // Another minter lost the race: it gets the cached value.
        let raced = cache.insert("a".into(), Arc::new(2), later());
        assert!(Arc::ptr_eq(&first, &raced));
        cache.expire("a");
        assert!(cache.get("a").is_none());
        let second = cache.insert("a".into(), Arc::new(3), later());
        assert_eq!(*second, 3);
        assert_eq!(cache.len(), 1);
    }
}
