//! TLS interception of CONNECT tunnels.
//!
//! This module owns:
//! - the interception CA on disk ([`generate_ca`] writes `ca.pem` + `ca.key`,
//!   [`CertAuthority::load`] reads and checks them);
//! - minting per-host leaf certificates signed by that CA, each with its own fresh key,
//!   kept in a bounded, least-recently-used cache of rustls `ServerConfig`s
//!   ([`Interceptor::server_config`]);
//! - terminating the client side of an intercepted tunnel ([`Interceptor::accept`]),
//!   with handshake failures explained in one line that names the host and the fix.
//!
//! The upstream side of an intercepted request is not handled here (see
//! [`crate::upstream_tls`]).

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{AlertDescription, ServerConfig};

/// Common name of the CA written by [`generate_ca`].
const CA_COMMON_NAME: &str = "sluice interception CA";
/// Lifetime of the CA written by [`generate_ca`] (about 10 years).
const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);
/// How far in the past certificates start, to tolerate clients with slow clocks.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);
/// Longest leaf lifetime [`Interceptor::new`] accepts (Apple clients reject longer).
const MAX_LEAF_VALIDITY: Duration = Duration::from_secs(825 * 24 * 3600);
/// Shortest leaf lifetime [`Interceptor::new`] accepts.
const MIN_LEAF_VALIDITY: Duration = Duration::from_secs(60);
/// Longest common name X.509 allows (ub-common-name); longer hosts get SAN only.
const MAX_COMMON_NAME_LEN: usize = 64;
/// Host name used to check, at load time, that the CA can sign verifiable leaves.
const PROBE_HOST: &str = "sluice-ca-self-test.invalid";

/// Errors of TLS interception.
#[derive(Debug, thiserror::Error)]
pub enum MitmError {
    /// `generate_ca` found an existing CA file and wrote nothing.
    #[error(
        "{path} already exists; refusing to overwrite an existing CA — keep using it, use another --dir, or delete ca.pem and ca.key to create a new one (clients must then trust the new ca.pem)"
    )]
    CaExists {
        /// The file that already exists.
        path: PathBuf,
    },
    /// A CA file given to [`CertAuthority::load`] does not exist.
    #[error(
        "{path} does not exist — create a CA with `sluice ca init --dir DIR` and point tls.ca_cert / tls.ca_key at its ca.pem / ca.key"
    )]
    CaMissing {
        /// The missing file.
        path: PathBuf,
    },
    /// A file or directory could not be read, created or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What sluice was doing, e.g. "read CA certificate".
        action: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: io::Error,
    },
    /// A CA file does not hold the expected PEM content.
    #[error("{path} is not a usable {expected}: {reason}")]
    BadPem {
        /// The offending file.
        path: PathBuf,
        /// What the file should contain, e.g. "PEM CA certificate".
        expected: &'static str,
        /// What is wrong with it, and what to do.
        reason: String,
    },
    /// The CA certificate and key load but cannot sign leaves clients would accept.
    #[error("the CA in {path} cannot sign interception certificates: {reason}")]
    BadCa {
        /// The CA certificate file.
        path: PathBuf,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// Creating a new CA failed before anything was written.
    #[error("cannot create the interception CA: {reason}")]
    CaGeneration {
        /// What failed.
        reason: String,
    },
    /// A leaf certificate (or its TLS configuration) could not be made for a host.
    #[error("cannot mint a TLS certificate for {host:?}: {reason}")]
    Mint {
        /// The host as given by the caller or the client.
        host: String,
        /// What failed.
        reason: String,
    },
    /// The TLS handshake with the intercepted client failed.
    #[error("TLS handshake with client for {host} failed: {reason}")]
    Handshake {
        /// The host whose certificate was (or would have been) presented.
        host: String,
        /// Why it failed, including the fix when sluice knows it.
        reason: String,
    },
}

/// Paths written by [`generate_ca`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFiles {
    /// The CA certificate (`ca.pem`); this is what clients must trust.
    pub cert: PathBuf,
    /// The CA private key (`ca.key`, PKCS#8 PEM, mode 0600); keep it secret.
    pub key: PathBuf,
}

/// Writes a new interception CA into `dir`, creating `dir` (mode 0700) if needed.
///
/// Writes `ca.pem` (the certificate, mode 0644) and `ca.key` (PKCS#8 PEM private key,
/// created with mode 0600). Refuses with [`MitmError::CaExists`] if either file already
/// exists, writing nothing. The CA has CN "sluice interception CA", `basicConstraints`
/// `cA=true, pathLen=0`, key usages keyCertSign + cRLSign, a fresh ECDSA P-256 key and
/// a validity of about 10 years.
pub fn generate_ca(dir: &Path) -> Result<CaFiles, MitmError> {
    let files = CaFiles {
        cert: dir.join("ca.pem"),
        key: dir.join("ca.key"),
    };
    for path in [&files.cert, &files.key] {
        // symlink_metadata: a dangling symlink counts as existing too.
        match fs::symlink_metadata(path) {
            Ok(_) => return Err(MitmError::CaExists { path: path.clone() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(MitmError::Io {
                    action: "check for an existing CA file",
                    path: path.clone(),
                    source,
                });
            }
        }
    }

    // Make everything before touching the disk.
    let (cert_pem, key_pem) = new_ca_pem()?;

    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| MitmError::Io {
            action: "create CA directory",
            path: dir.to_path_buf(),
            source,
        })?;
    write_new_file(&files.key, key_pem.as_bytes(), 0o600)?;
    if let Err(e) = write_new_file(&files.cert, cert_pem.as_bytes(), 0o644) {
        let _ = fs::remove_file(&files.key);
        return Err(e);
    }
    Ok(files)
}

/// A new self-signed CA: (certificate PEM, PKCS#8 key PEM).
fn new_ca_pem() -> Result<(String, String), MitmError> {
    let fail = |e: rcgen::Error| MitmError::CaGeneration {
        reason: e.to_string(),
    };
    let key = KeyPair::generate().map_err(fail)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, CA_VALIDITY).map_err(|reason| MitmError::CaGeneration { reason })?;
    let cert = params.self_signed(&key).map_err(fail)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Creates `path` (which must not exist) with `mode` and writes `contents`.
fn write_new_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), MitmError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|source| match source.kind() {
            io::ErrorKind::AlreadyExists => MitmError::CaExists {
                path: path.to_path_buf(),
            },
            _ => MitmError::Io {
                action: "create",
                path: path.to_path_buf(),
                source,
            },
        })?;
    let written = file
        // The umask may only have removed bits; make the mode exact.
        .set_permissions(fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(contents))
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        drop(file);
        let _ = fs::remove_file(path);
        return Err(MitmError::Io {
            action: "write",
            path: path.to_path_buf(),
            source,
        });
    }
    Ok(())
}

/// Sets `not_before` to now minus [`CLOCK_SKEW`] and `not_after` to now plus `validity`.
fn set_validity(params: &mut CertificateParams, validity: Duration) -> Result<(), String> {
    // Last second of 9999-12-31: the latest time X.509 can express.
    const MAX_UNIX: u64 = 253_402_300_799;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|_| "the system clock is set before 1970".to_owned())?;
    let not_before = now
        .checked_sub(CLOCK_SKEW)
        .ok_or_else(|| "the system clock is set to 1970".to_owned())?;
    let not_after = now
        .checked_add(validity)
        .filter(|t| t.as_secs() <= MAX_UNIX)
        .ok_or_else(|| "the certificate would expire after the year 9999".to_owned())?;
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + not_before;
    params.not_after = epoch + not_after;
    Ok(())
}

/// A loaded CA able to sign leaf certificates.
pub struct CertAuthority {
    /// Subject, key identifier and signing key of the CA.
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, sent after each leaf.
    cert_der: CertificateDer<'static>,
    /// Where the certificate was loaded from (named in handshake errors).
    cert_path: PathBuf,
    /// Whether leaves carry an authorityKeyIdentifier (the CA has a subjectKeyIdentifier).
    authority_key_id: bool,
}

impl fmt::Debug for CertAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertAuthority")
            .field("cert_path", &self.cert_path)
            .finish_non_exhaustive()
    }
}

impl CertAuthority {
    /// Loads a PEM CA certificate and its PEM private key (PKCS#8, e.g. from [`generate_ca`]).
    ///
    /// Besides parsing, checks that the certificate is a CA, that the key belongs to it,
    /// and that a test leaf it signs verifies against it; any failure names the file and
    /// what to do. CAs not made by sluice work too, provided their key is PKCS#8
    /// (ECDSA P-256/P-384, Ed25519 or RSA) and their subject uses single-valued,
    /// non-repeated attributes.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, MitmError> {
        let cert_der = read_cert(cert)?;
        let key_pair = read_key(key)?;

        let bad_ca = |reason: String| MitmError::BadCa {
            path: cert.to_path_buf(),
            reason,
        };
        let info = der::parse_certificate(&cert_der).map_err(|reason| MitmError::BadPem {
            path: cert.to_path_buf(),
            expected: "PEM CA certificate",
            reason: format!("the CERTIFICATE block is not a valid X.509 certificate ({reason})"),
        })?;
        if !info.is_ca {
            return Err(bad_ca(
                "it is not a CA certificate (basicConstraints cA is not set) — create one with `sluice ca init --dir DIR` and point tls.ca_cert / tls.ca_key at it".to_owned(),
            ));
        }
        if info.spki != key_pair.subject_public_key_info().as_slice() {
            return Err(bad_ca(format!(
                "the private key in {} does not belong to this certificate — load the key that was generated with it",
                key.display()
            )));
        }
        let subject = der::name_to_dn(&info.subject).map_err(|reason| {
            bad_ca(format!(
                "sluice cannot reproduce its subject name ({reason})"
            ))
        })?;

        let mut params = CertificateParams::default();
        params.distinguished_name = subject;
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.key_identifier_method = match &info.ski {
            Some(id) => KeyIdMethod::PreSpecified(id.clone()),
            None => KeyIdMethod::Sha256,
        };
        let ca = Self {
            issuer: Issuer::new(params, key_pair),
            cert_der: cert_der.clone(),
            cert_path: cert.to_path_buf(),
            authority_key_id: info.ski.is_some(),
        };
        ca.self_test(info.subject.raw).map_err(bad_ca)?;
        Ok(ca)
    }

    /// The CA certificate in DER (what clients must trust).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The file the CA certificate was loaded from.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// Signs a leaf for [`PROBE_HOST`] and checks that rustls' verifier accepts it.
    fn self_test(&self, subject_der: &[u8]) -> Result<(), String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let host = Host::parse(PROBE_HOST)?;
        let (chain, _key) = self.mint(&host, Duration::from_secs(3600))?;
        let leaf = chain
            .first()
            .ok_or_else(|| "no certificate was minted".to_owned())?;
        let leaf_info = der::parse_certificate(leaf)?;
        if leaf_info.issuer != subject_der {
            return Err(
                "sluice cannot reproduce its subject name byte for byte (unusual string encoding)"
                    .to_owned(),
            );
        }
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.cert_der.clone())
            .map_err(|e| format!("rustls cannot use it as a trust anchor ({e})"))?;
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("rustls cannot use it as a trust anchor ({e})"))?;
        let name = ServerName::try_from(PROBE_HOST).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
            .map_err(|e| format!("a test certificate it signed does not verify ({e})"))?;
        Ok(())
    }

    /// Mints a leaf for `host` with its own fresh key: ([leaf, CA], leaf key).
    fn mint(
        &self,
        host: &Host,
        validity: Duration,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
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
        params.use_authority_key_identifier_extension = self.authority_key_id;
        set_validity(&mut params, validity)?;
        let leaf = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| format!("cannot sign the certificate: {e}"))?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![leaf.der().clone(), self.cert_der.clone()], key_der))
    }
}

fn read_error(action: &'static str, path: &Path, source: io::Error) -> MitmError {
    match source.kind() {
        io::ErrorKind::NotFound => MitmError::CaMissing {
            path: path.to_path_buf(),
        },
        _ => MitmError::Io {
            action,
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Reads the first CERTIFICATE block of a PEM file.
fn read_cert(path: &Path) -> Result<CertificateDer<'static>, MitmError> {
    let pem = fs::read(path).map_err(|source| read_error("read CA certificate", path, source))?;
    let bad = |reason: String| MitmError::BadPem {
        path: path.to_path_buf(),
        expected: "PEM CA certificate",
        reason,
    };
    match rustls_pemfile::certs(&mut pem.as_slice()).next() {
        Some(Ok(cert)) => Ok(cert),
        Some(Err(e)) => Err(bad(format!("malformed PEM ({e})"))),
        None => Err(bad(
            "no `-----BEGIN CERTIFICATE-----` block found — create a CA with `sluice ca init --dir DIR` and point tls.ca_cert at its ca.pem".to_owned(),
        )),
    }
}

/// Reads the private key of a PEM file.
fn read_key(path: &Path) -> Result<KeyPair, MitmError> {
    let pem = fs::read(path).map_err(|source| read_error("read CA private key", path, source))?;
    let bad = |reason: String| MitmError::BadPem {
        path: path.to_path_buf(),
        expected: "PEM CA private key",
        reason,
    };
    let key = match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return Err(bad(
                "no unencrypted `-----BEGIN PRIVATE KEY-----` block found — create a CA with `sluice ca init --dir DIR` and point tls.ca_key at its ca.key".to_owned(),
            ));
        }
        Err(e) => return Err(bad(format!("malformed PEM ({e})"))),
    };
    if !matches!(key, PrivateKeyDer::Pkcs8(_)) {
        return Err(bad(format!(
            "the key is not PKCS#8 — convert it with `openssl pkcs8 -topk8 -nocrypt -in {}`",
            path.display()
        )));
    }
    KeyPair::try_from(&key).map_err(|e| bad(format!("unsupported or corrupt key ({e})")))
}

/// A host a leaf is minted for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    /// A DNS name, lower-case, without trailing dot.
    Dns(String),
    /// An IP literal.
    Ip(IpAddr),
}

impl Host {
    /// Parses a DNS name or IP literal (IPv6 optionally in brackets).
    fn parse(host: &str) -> Result<Self, String> {
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
    fn key(&self) -> String {
        match self {
            Self::Dns(name) => name.clone(),
            Self::Ip(ip) => ip.to_string(),
        }
    }
}

/// Terminates intercepted CONNECT tunnels with freshly minted per-host leaves.
///
/// `Send + Sync`: share one instance via `Arc` across connections.
pub struct Interceptor {
    ca: CertAuthority,
    provider: Arc<CryptoProvider>,
    capacity: usize,
    validity: Duration,
    cache: Mutex<Cache>,
}

/// Host → ServerConfig, bounded, least-recently-used eviction.
#[derive(Default)]
struct Cache {
    entries: HashMap<String, Entry>,
    /// Logical clock for recency.
    tick: u64,
}

struct Entry {
    config: Arc<ServerConfig>,
    /// When less than a quarter of the leaf's validity remains.
    refresh_at: Instant,
    last_used: u64,
}

impl fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Interceptor")
            .field("ca", &self.ca)
            .field("capacity", &self.capacity)
            .field("validity", &self.validity)
            .field("cached_hosts", &self.cached_hosts())
            .finish_non_exhaustive()
    }
}

impl Interceptor {
    /// Creates an interceptor signing with `ca`.
    ///
    /// `capacity`: most hosts whose leaf is kept (least recently used evicted first;
    /// at least 1). `validity`: leaf lifetime (e.g. 24 h; clamped to 1 minute … 825 days);
    /// a cached leaf is re-minted once less than a quarter of it remains.
    pub fn new(ca: CertAuthority, capacity: usize, validity: Duration) -> Self {
        Self {
            ca,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
            capacity: capacity.max(1),
            validity: validity.clamp(MIN_LEAF_VALIDITY, MAX_LEAF_VALIDITY),
            cache: Mutex::new(Cache::default()),
        }
    }

    /// The CA this interceptor signs with.
    pub fn ca(&self) -> &CertAuthority {
        &self.ca
    }

    /// The rustls `ServerConfig` for `host`, minted once and cached.
    ///
    /// `host` is a DNS name or an IP literal (IPv6 optionally in brackets, `[::1]`), without
    /// port; DNS names are matched case-insensitively. The leaf has its own fresh key, SAN
    /// = the DNS name or IP address, CN = host, `notBefore` one hour in the past,
    /// `notAfter` = now + validity, EKU serverAuth, and is not a CA. The chain sent is
    /// `[leaf, CA]`; ALPN advertised is `["h2", "http/1.1"]` (the sender chooses).
    pub fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, MitmError> {
        let mint_error = |reason: String| MitmError::Mint {
            host: host.to_owned(),
            reason,
        };
        let parsed = Host::parse(host).map_err(mint_error)?;
        let key = parsed.key();
        if let Some(config) = self.cached(&key) {
            return Ok(config);
        }
        // Mint outside the lock; if another thread won the race, use its config.
        let minted_at = Instant::now();
        let (chain, leaf_key) = self.ca.mint(&parsed, self.validity).map_err(mint_error)?;
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_no_client_auth().with_single_cert(chain, leaf_key))
            .map_err(|e| mint_error(format!("rustls rejected the certificate: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let refresh_at = minted_at + self.validity - self.validity / 4;
        Ok(self.insert(key, Arc::new(config), refresh_at))
    }

    /// Number of hosts currently cached.
    pub fn cached_hosts(&self) -> usize {
        self.lock().entries.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // Every critical section leaves the map consistent, so a poisoned lock is usable.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached, still fresh config for `key`, marking it used.
    fn cached(&self, key: &str) -> Option<Arc<ServerConfig>> {
        let mut cache = self.lock();
        cache.tick += 1;
        let tick = cache.tick;
        let entry = cache.entries.get_mut(key)?;
        if Instant::now() >= entry.refresh_at {
            return None;
        }
        entry.last_used = tick;
        Some(entry.config.clone())
    }

    /// Caches `config` for `key` (evicting the least recently used host if full), unless a
    /// fresh config was cached meanwhile, which is returned instead.
    fn insert(
        &self,
        key: String,
        config: Arc<ServerConfig>,
        refresh_at: Instant,
    ) -> Arc<ServerConfig> {
        let mut cache = self.lock();
        cache.tick += 1;
        let tick = cache.tick;
        if let Some(entry) = cache.entries.get_mut(&key) {
            if Instant::now() < entry.refresh_at {
                entry.last_used = tick;
                return entry.config.clone();
            }
        } else if cache.entries.len() >= self.capacity {
            let oldest = cache
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                cache.entries.remove(&oldest);
            }
        }
        cache.entries.insert(
            key,
            Entry {
                config: config.clone(),
                refresh_at,
                last_used: tick,
            },
        );
        config
    }

    /// Terminates TLS on `io`, a client connection already past the `CONNECT` 200.
    ///
    /// Reads the ClientHello, picks its SNI name if present, else `authority_host` (the
    /// CONNECT target host, without port), and completes the handshake with
    /// [`server_config`](Self::server_config) for that name. Returns the stream and the
    /// name used, verbatim (the SNI as sent, or `authority_host` as given): it may differ
    /// from `authority_host`. A failed handshake gives [`MitmError::Handshake`] naming the
    /// host and, when the client rejected the certificate, the CA file it must trust.
    /// No timeout is applied: wrap the call in `tokio::time::timeout`.
    pub async fn accept<IO>(
        &self,
        io: IO,
        authority_host: &str,
    ) -> Result<(tokio_rustls::server::TlsStream<IO>, String), MitmError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let start = tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io)
            .await
            .map_err(|e| self.handshake_error(authority_host, &e))?;
        let host = start
            .client_hello()
            .server_name()
            .unwrap_or(authority_host)
            .to_owned();
        let config = self.server_config(&host)?;
        let stream = start
            .into_stream(config)
            .await
            .map_err(|e| self.handshake_error(&host, &e))?;
        Ok((stream, host))
    }

    /// One line saying why the handshake with the client failed and what to do.
    fn handshake_error(&self, host: &str, err: &io::Error) -> MitmError {
        let trust = format!("make the client trust {}", self.ca.cert_path.display());
        let reason = match crate::upstream_tls::find_rustls(err) {
            Some(rustls::Error::AlertReceived(alert)) => match alert {
                AlertDescription::UnknownCA => {
                    format!("client rejected sluice's certificate (unknown CA) — {trust}")
                }
                AlertDescription::BadCertificate
                | AlertDescription::CertificateUnknown
                | AlertDescription::UnsupportedCertificate => {
                    format!("client rejected sluice's certificate ({alert:?}) — {trust}")
                }
                other => format!("client sent TLS alert {other:?}"),
            },
            Some(rustls::Error::NoApplicationProtocol) => {
                "client offered no ALPN protocol sluice supports (only http/1.1 is supported inside intercepted tunnels)".to_owned()
            }
            Some(rustls::Error::InvalidMessage(_)) => {
                "client did not send a valid TLS handshake (is it sending plain HTTP inside the CONNECT tunnel?)".to_owned()
            }
            Some(other) => other.to_string(),
            None => match err.kind() {
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => format!(
                    "client closed the connection during the handshake (if it does not trust sluice's CA: {trust})"
                ),
                _ => err.to_string(),
            },
        };
        MitmError::Handshake {
            host: host.to_owned(),
            reason,
        }
    }
}

/// Just enough DER reading to take a CA certificate apart (rcgen 0.14 without its
/// `x509-parser` feature cannot): subject and issuer names, public key, subject key
/// identifier and basic constraints.
mod der {
    use rcgen::string::{BmpString, Ia5String, PrintableString, TeletexString, UniversalString};
    use rcgen::{DistinguishedName, DnType, DnValue};

    const BOOLEAN: u8 = 0x01;
    const INTEGER: u8 = 0x02;
    const OCTET_STRING: u8 = 0x04;
    const OID: u8 = 0x06;
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const VERSION: u8 = 0xa0;
    const EXTENSIONS: u8 = 0xa3;
    /// 2.5.29.14
    const OID_SUBJECT_KEY_ID: &[u8] = &[0x55, 0x1d, 0x0e];
    /// 2.5.29.19
    const OID_BASIC_CONSTRAINTS: &[u8] = &[0x55, 0x1d, 0x13];

    /// One DER element.
    pub(super) struct Tlv<'a> {
        pub(super) tag: u8,
        pub(super) content: &'a [u8],
        /// Tag, length and content.
        pub(super) raw: &'a [u8],
    }

    /// The parts of a certificate the CA loader needs.
    pub(super) struct CertInfo<'a> {
        /// Encoded issuer Name.
        pub(super) issuer: &'a [u8],
        pub(super) subject: Tlv<'a>,
        /// Encoded SubjectPublicKeyInfo.
        pub(super) spki: &'a [u8],
        pub(super) ski: Option<Vec<u8>>,
        pub(super) is_ca: bool,
    }

    /// Reads one element; returns it and what follows.
    pub(super) fn read(input: &[u8]) -> Result<(Tlv<'_>, &[u8]), String> {
        let truncated = || "truncated DER".to_owned();
        let (&tag, rest) = input.split_first().ok_or_else(truncated)?;
        if tag & 0x1f == 0x1f {
            return Err("unsupported DER tag".to_owned());
        }
        let (&first, mut rest) = rest.split_first().ok_or_else(truncated)?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return Err("bad DER length".to_owned());
            }
            let (bytes, after) = rest.split_at(n);
            rest = after;
            bytes
                .iter()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
        };
        if rest.len() < len {
            return Err(truncated());
        }
        let header = input.len() - rest.len();
        let (content, after) = rest.split_at(len);
        Ok((
            Tlv {
                tag,
                content,
                raw: &input[..header + len],
            },
            after,
        ))
    }

    fn expect<'a>(input: &'a [u8], tag: u8, what: &str) -> Result<(Tlv<'a>, &'a [u8]), String> {
        let (tlv, rest) = read(input)?;
        if tlv.tag != tag {
            return Err(format!("expected {what}"));
        }
        Ok((tlv, rest))
    }

    pub(super) fn parse_certificate(der: &[u8]) -> Result<CertInfo<'_>, String> {
        let (cert, _) = expect(der, SEQUENCE, "certificate")?;
        let (tbs, _) = expect(cert.content, SEQUENCE, "tbsCertificate")?;
        let mut rest = tbs.content;
        let (first, after) = read(rest)?;
        if first.tag == VERSION {
            rest = after;
        }
        let (_, rest) = expect(rest, INTEGER, "serial number")?;
        let (_, rest) = expect(rest, SEQUENCE, "signature algorithm")?;
        let (issuer, rest) = expect(rest, SEQUENCE, "issuer")?;
        let (_, rest) = expect(rest, SEQUENCE, "validity")?;
        let (subject, rest) = expect(rest, SEQUENCE, "subject")?;
        let (spki, mut rest) = expect(rest, SEQUENCE, "subject public key info")?;

        let mut info = CertInfo {
            issuer: issuer.raw,
            subject,
            spki: spki.raw,
            ski: None,
            is_ca: false,
        };
        while !rest.is_empty() {
            let (field, after) = read(rest)?;
            rest = after;
            if field.tag != EXTENSIONS {
                continue; // issuerUniqueID / subjectUniqueID
            }
            let (exts, _) = expect(field.content, SEQUENCE, "extensions")?;
            let mut list = exts.content;
            while !list.is_empty() {
                let (ext, after) = expect(list, SEQUENCE, "extension")?;
                list = after;
                let (oid, body) = expect(ext.content, OID, "extension id")?;
                let (mut value, body) = read(body)?;
                if value.tag == BOOLEAN {
                    (value, _) = read(body)?; // skip `critical`
                }
                if value.tag != OCTET_STRING {
                    return Err("expected extension value".to_owned());
                }
                if oid.content == OID_SUBJECT_KEY_ID {
                    let (id, _) = expect(value.content, OCTET_STRING, "key identifier")?;
                    info.ski = Some(id.content.to_vec());
                } else if oid.content == OID_BASIC_CONSTRAINTS {
                    let (bc, _) = expect(value.content, SEQUENCE, "basic constraints")?;
                    if !bc.content.is_empty() {
                        let (ca, _) = read(bc.content)?;
                        info.is_ca = ca.tag == BOOLEAN && ca.content.iter().any(|&b| b != 0);
                    }
                }
            }
        }
        Ok(info)
    }

    /// Rebuilds an encoded Name as an rcgen name (which encodes it back identically).
    pub(super) fn name_to_dn(name: &Tlv<'_>) -> Result<DistinguishedName, String> {
        let mut dn = DistinguishedName::new();
        let mut rdns = name.content;
        while !rdns.is_empty() {
            let (rdn, after) = expect(rdns, SET, "relative distinguished name")?;
            rdns = after;
            let (atv, more) = expect(rdn.content, SEQUENCE, "name attribute")?;
            if !more.is_empty() {
                return Err("multi-valued name components are not supported".to_owned());
            }
            let (oid, rest) = expect(atv.content, OID, "attribute type")?;
            let (value, _) = read(rest)?;
            let ty = DnType::from_oid(&oid_arcs(oid.content)?);
            if dn.get(&ty).is_some() {
                return Err(format!("the name repeats the attribute {ty:?}"));
            }
            dn.push(ty, dn_value(&value)?);
        }
        Ok(dn)
    }

    fn dn_value(value: &Tlv<'_>) -> Result<DnValue, String> {
        let text = || std::str::from_utf8(value.content).map_err(|e| e.to_string());
        let invalid = |e: rcgen::Error| e.to_string();
        Ok(match value.tag {
            0x0c => DnValue::Utf8String(text()?.to_owned()),
            0x13 => DnValue::PrintableString(PrintableString::try_from(text()?).map_err(invalid)?),
            0x16 => DnValue::Ia5String(Ia5String::try_from(text()?).map_err(invalid)?),
            0x14 => DnValue::TeletexString(TeletexString::try_from(text()?).map_err(invalid)?),
            0x1e => DnValue::BmpString(
                BmpString::from_utf16be(value.content.to_vec()).map_err(invalid)?,
            ),
            0x1c => DnValue::UniversalString(
                UniversalString::from_utf32be(value.content.to_vec()).map_err(invalid)?,
            ),
            tag => return Err(format!("unsupported string type (DER tag {tag:#04x})")),
        })
    }

    fn oid_arcs(bytes: &[u8]) -> Result<Vec<u64>, String> {
        let mut subids = Vec::new();
        let mut acc: u64 = 0;
        for (i, &b) in bytes.iter().enumerate() {
            if acc > u64::MAX >> 7 {
                return Err("object identifier too large".to_owned());
            }
            acc = (acc << 7) | u64::from(b & 0x7f);
            if b & 0x80 == 0 {
                subids.push(acc);
                acc = 0;
            } else if i + 1 == bytes.len() {
                return Err("truncated object identifier".to_owned());
            }
        }
        let (&first, rest) = subids
            .split_first()
            .ok_or_else(|| "empty object identifier".to_owned())?;
        let (a, b) = match first {
            0..=39 => (0, first),
            40..=79 => (1, first - 40),
            _ => (2, first - 80),
        };
        let mut arcs = vec![a, b];
        arcs.extend_from_slice(rest);
        Ok(arcs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream_tls::client_config;
    use rustls::server::ParsedCertificate;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn new_ca(dir: &Path) -> CertAuthority {
        let files = generate_ca(dir).unwrap();
        CertAuthority::load(&files.cert, &files.key).unwrap()
    }

    fn spki(cert: &CertificateDer<'_>) -> Vec<u8> {
        ParsedCertificate::try_from(cert)
            .unwrap()
            .subject_public_key_info()
            .as_ref()
            .to_vec()
    }

    #[test]
    fn interceptor_is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<Interceptor>();
        check::<CertAuthority>();
    }

    #[test]
    fn generate_ca_writes_files_and_refuses_to_overwrite() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("nested/ca");
        let files = generate_ca(&dir).unwrap();
        assert_eq!(files.cert, dir.join("ca.pem"));
        assert_eq!(files.key, dir.join("ca.key"));
        let cert = fs::read_to_string(&files.cert).unwrap();
        let key = fs::read_to_string(&files.key).unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
        assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"));
        let mode = fs::metadata(&files.key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let err = generate_ca(&dir).unwrap_err();
        assert!(matches!(err, MitmError::CaExists { .. }), "{err}");
        assert!(err.to_string().contains("ca.pem"), "{err}");
        assert_eq!(fs::read_to_string(&files.cert).unwrap(), cert);
        assert_eq!(fs::read_to_string(&files.key).unwrap(), key);

        // Only the key left: still refused, nothing written.
        fs::remove_file(&files.cert).unwrap();
        let err = generate_ca(&dir).unwrap_err();
        assert!(err.to_string().contains("ca.key"), "{err}");
        assert!(!files.cert.exists());
        assert_eq!(fs::read_to_string(&files.key).unwrap(), key);
    }

    #[test]
    fn load_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let files = generate_ca(tmp.path()).unwrap();
        let ca = CertAuthority::load(&files.cert, &files.key).unwrap();
        let pem = fs::read(&files.cert).unwrap();
        let from_file = rustls_pemfile::certs(&mut pem.as_slice())
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(ca.cert_der(), &from_file);
        assert_eq!(ca.cert_path(), files.cert);
        let info = der::parse_certificate(ca.cert_der()).unwrap();
        assert!(info.is_ca);
        assert!(info.ski.is_some());
        assert_eq!(
            der::name_to_dn(&info.subject)
                .unwrap()
                .get(&DnType::CommonName),
            Some(&rcgen::DnValue::Utf8String(CA_COMMON_NAME.to_owned()))
        );
    }

    #[test]
    fn load_errors_name_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let files = generate_ca(&tmp.path().join("ca")).unwrap();
        let missing = tmp.path().join("missing.pem");
        let garbage = tmp.path().join("garbage.pem");
        fs::write(&garbage, "this is not PEM\n").unwrap();

        for (cert, key, named) in [
            (&missing, &files.key, &missing),
            (&garbage, &files.key, &garbage),
            (&files.cert, &missing, &missing),
            (&files.cert, &garbage, &garbage),
            // Swapped: the key file holds no key.
            (&files.key, &files.cert, &files.key),
        ] {
            let err = CertAuthority::load(cert, key).unwrap_err();
            let msg = err.to_string();
            if named == &missing {
                assert!(matches!(err, MitmError::CaMissing { .. }), "{err}");
                assert!(msg.contains("sluice ca init"), "{msg}");
            }
            assert!(
                msg.contains(&named.display().to_string()),
                "{msg} should name {}",
                named.display()
            );
        }

        // A key that does not belong to the certificate.
        let other = generate_ca(&tmp.path().join("other")).unwrap();
        let err = CertAuthority::load(&files.cert, &other.key).unwrap_err();
        assert!(matches!(err, MitmError::BadCa { .. }), "{err}");
        assert!(err.to_string().contains("does not belong"), "{err}");

        // A leaf certificate is not a CA.
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["leaf.example".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let leaf_pem = tmp.path().join("leaf.pem");
        let leaf_key = tmp.path().join("leaf.key");
        fs::write(&leaf_pem, leaf.pem()).unwrap();
        fs::write(&leaf_key, key.serialize_pem()).unwrap();
        let err = CertAuthority::load(&leaf_pem, &leaf_key).unwrap_err();
        assert!(err.to_string().contains("not a CA"), "{err}");
    }

    #[test]
    fn loads_a_foreign_ca_with_a_richer_subject() {
        let tmp = tempfile::tempdir().unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CountryName,
            rcgen::DnValue::PrintableString("DE".try_into().unwrap()),
        );
        dn.push(DnType::OrganizationName, "Ümlaut GmbH");
        dn.push(DnType::CommonName, "Corp Root");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        params.key_identifier_method = KeyIdMethod::PreSpecified(vec![1, 2, 3, 4]);
        let cert = params.self_signed(&key).unwrap();
        let cert_path = tmp.path().join("corp.pem");
        let key_path = tmp.path().join("corp.key");
        fs::write(&cert_path, cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        let ca = CertAuthority::load(&cert_path, &key_path).unwrap();
        let icpt = Interceptor::new(ca, 4, Duration::from_secs(3600));
        icpt.server_config("x.example").unwrap();
    }

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
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 4, Duration::from_secs(3600));
        let err = icpt.server_config("exa mple.com").unwrap_err();
        assert!(matches!(err, MitmError::Mint { .. }));
        assert!(err.to_string().contains("exa mple.com"), "{err}");
    }

    struct Handshake {
        server: Result<(String, Vec<u8>), MitmError>,
        client: Result<(Vec<CertificateDer<'static>>, Option<Vec<u8>>), io::Error>,
    }

    /// Runs `accept` against a tokio-rustls client asking for `name` with `config`;
    /// on success the client sends "ping" and the server answers "pong".
    async fn handshake(
        icpt: &Interceptor,
        authority: &str,
        name: ServerName<'static>,
        config: rustls::ClientConfig,
    ) -> Handshake {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let server = async {
            let (mut tls, host) = icpt.accept(server_io, authority).await?;
            let mut buf = [0u8; 4];
            tls.read_exact(&mut buf)
                .await
                .map_err(|e| MitmError::Handshake {
                    host: host.clone(),
                    reason: e.to_string(),
                })?;
            let _ = tls.write_all(b"pong").await;
            let _ = tls.flush().await;
            Ok((host, buf.to_vec()))
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let client = async move {
            let mut tls = connector.connect(name, client_io).await?;
            tls.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            tls.read_exact(&mut buf).await?;
            assert_eq!(&buf, b"pong");
            let conn = tls.get_ref().1;
            let certs = conn.peer_certificates().unwrap_or_default().to_vec();
            Ok((certs, conn.alpn_protocol().map(<[u8]>::to_vec)))
        };
        let (server, client) = tokio::join!(server, client);
        Handshake { server, client }
    }

    fn trusting_config(dir: &Path) -> rustls::ClientConfig {
        client_config(&[dir.join("ca.pem")]).unwrap()
    }

    #[tokio::test]
    async fn handshake_with_dns_name_and_ip() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = new_ca(tmp.path());
        let ca_der = ca.cert_der().clone();
        let icpt = Interceptor::new(ca, 16, Duration::from_secs(24 * 3600));
        let config = trusting_config(tmp.path());

        for (authority, name, expect_host) in [
            // SNI wins over the CONNECT authority.
            ("ignored.example", "api.example.com", "api.example.com"),
            // No SNI for IP addresses: the authority is used.
            ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
            ("[::1]", "::1", "[::1]"),
        ] {
            let server_name = ServerName::try_from(name.to_owned()).unwrap();
            let hs = handshake(&icpt, authority, server_name.clone(), config.clone()).await;
            let (host, ping) = hs.server.unwrap();
            assert_eq!(host, expect_host);
            assert_eq!(ping, b"ping");
            let (chain, alpn) = hs.client.unwrap();
            assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
            assert_eq!(chain.len(), 2);
            assert_eq!(chain[1], ca_der);
            let leaf = ParsedCertificate::try_from(&chain[0]).unwrap();
            rustls::client::verify_server_name(&leaf, &server_name).unwrap();
            let other = ServerName::try_from("other.example").unwrap();
            assert!(rustls::client::verify_server_name(&leaf, &other).is_err());
            assert_ne!(spki(&chain[0]), spki(&ca_der), "leaf must have its own key");
            let info = der::parse_certificate(&chain[0]).unwrap();
            assert!(!info.is_ca);
        }
        assert_eq!(icpt.cached_hosts(), 3);
    }

    #[tokio::test]
    async fn untrusting_client_gets_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 16, Duration::from_secs(3600));
        let config = client_config(&[]).unwrap(); // system roots only
        let name = ServerName::try_from("api.example.com").unwrap();
        let hs = handshake(&icpt, "api.example.com", name, config).await;
        assert!(hs.client.is_err());
        let err = hs.server.unwrap_err();
        assert!(matches!(err, MitmError::Handshake { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("api.example.com"), "{msg}");
        assert!(msg.contains("unknown CA"), "{msg}");
        assert!(msg.contains("ca.pem"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[tokio::test]
    async fn plain_http_client_gets_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 16, Duration::from_secs(3600));
        let (mut client_io, server_io) = tokio::io::duplex(4096);
        client_io
            .write_all(b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n")
            .await
            .unwrap();
        let err = icpt.accept(server_io, "api.example.com").await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("api.example.com") && msg.contains("plain HTTP"),
            "{msg}"
        );
        drop(client_io);
    }

    #[test]
    fn cache_is_bounded_and_reuses_configs() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 100, Duration::from_secs(3600));
        let first = icpt.server_config("host0.example").unwrap();
        for i in 0..300 {
            icpt.server_config(&format!("host{i}.example")).unwrap();
            assert!(icpt.cached_hosts() <= 100);
        }
        assert_eq!(icpt.cached_hosts(), 100);
        // host0 was evicted long ago: a new config.
        let again = icpt.server_config("host0.example").unwrap();
        assert!(!Arc::ptr_eq(&first, &again));
        // Same host (any spelling) twice: the same config.
        let a = icpt.server_config("Same.Example").unwrap();
        let b = icpt.server_config("same.example").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let ip1 = icpt.server_config("[::1]").unwrap();
        let ip2 = icpt.server_config("::1").unwrap();
        assert!(Arc::ptr_eq(&ip1, &ip2));
        assert!(icpt.cached_hosts() <= 100);
    }

    #[test]
    fn cache_evicts_least_recently_used() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 2, Duration::from_secs(3600));
        let a = icpt.server_config("a.example").unwrap();
        icpt.server_config("b.example").unwrap();
        // Touch a, so b is the least recently used.
        assert!(Arc::ptr_eq(&a, &icpt.server_config("a.example").unwrap()));
        icpt.server_config("c.example").unwrap();
        assert_eq!(icpt.cached_hosts(), 2);
        assert!(Arc::ptr_eq(&a, &icpt.server_config("a.example").unwrap()));
    }

    #[test]
    fn stale_leaves_are_reminted() {
        let tmp = tempfile::tempdir().unwrap();
        // Validity is clamped to one minute; forge an entry already due for refresh.
        let icpt = Interceptor::new(new_ca(tmp.path()), 4, Duration::ZERO);
        assert_eq!(icpt.validity, MIN_LEAF_VALIDITY);
        let first = icpt.server_config("a.example").unwrap();
        icpt.lock().entries.get_mut("a.example").unwrap().refresh_at = Instant::now();
        let second = icpt.server_config("a.example").unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(icpt.cached_hosts(), 1);
        assert!(Arc::ptr_eq(
            &second,
            &icpt.server_config("a.example").unwrap()
        ));
    }
}
