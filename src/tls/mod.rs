//! TLS: interception of CONNECT tunnels with sluice's own CA, and the trust sluice uses
//! when it talks TLS upstream.
//!
//! Each file owns one job:
//! - [`ca`]: the interception CA on disk — [`generate_ca`] writes `ca.pem` + `ca.key`,
//!   [`CertAuthority::load`] reads them, checks them and proves with a self-test that a
//!   leaf it signs verifies; the CA signs every leaf.
//! - [`leaf`]: what a per-host leaf looks like (SAN, CN, EKU, validity), the rustls
//!   `ServerConfig` built around it, and the bounded least-recently-used cache of those
//!   configs.
//! - [`intercept`]: the [`Interceptor`] that terminates the client side of an intercepted
//!   tunnel ([`Interceptor::accept`]), with handshake failures explained in one line that
//!   names the host and the fix.
//! - [`upstream`]: the rustls client configuration for connections sluice makes upstream,
//!   and short reasons for failed upstream handshakes.
//! - this file: [`MitmError`] and the crypto provider both sides use
//!   (`crypto_provider`: rustls' ring suites, AES-128-GCM first).
//!
//! Dependencies run one way: `intercept → ca → leaf`; `upstream` uses only this file's
//! `crypto_provider`, as all of them do.
//! Certificates are taken apart with rcgen's own reader ([`rcgen::Issuer::from_ca_cert_der`])
//! and `x509-parser`, never by hand.

use std::io;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::CertificateParams;

pub mod ca;
pub mod intercept;
pub mod leaf;
pub mod upstream;

pub use ca::{CaFiles, CertAuthority, generate_ca};
pub use intercept::Interceptor;
pub use upstream::{UpstreamTlsError, client_config, describe_failure, find_rustls};

/// The crypto sluice's TLS uses on both sides of an intercepted tunnel: rustls' ring
/// provider, with the AES-128-GCM suites (TLS 1.3's `TLS13_AES_128_GCM_SHA256`, then
/// TLS 1.2's ECDHE ones) moved first.
///
/// Every suite stays offered; only the order changes, to the one Go, Chrome and Firefox
/// use. These suites run the handshake's key schedule (TLS 1.2: its PRF) and transcript
/// hash on SHA-256, which ring computes with the CPU's SHA instructions where it has
/// them; SHA-384 ran in ring's portable code, 8–10% of sluice's CPU for a fresh tunnel
/// on the benchmark box. The intercepting side applies its own order over the sender's
/// ([`leaf::server_config`]); upstream, it is the order sluice offers.
pub(crate) fn crypto_provider() -> rustls::crypto::CryptoProvider {
    use rustls::CipherSuite::{
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        TLS13_AES_128_GCM_SHA256,
    };
    const FIRST: [rustls::CipherSuite; 3] = [
        TLS13_AES_128_GCM_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    ];
    let mut provider = rustls::crypto::ring::default_provider();
    // A stable sort: TLS 1.3 before TLS 1.2 stays, and so does the rest's order.
    provider
        .cipher_suites
        .sort_by_key(|s| !FIRST.contains(&s.suite()));
    provider
}

/// How far in the past certificates start, to tolerate clients with slow clocks.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);

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

/// Sets `not_before` to now minus [`CLOCK_SKEW`] and `not_after` to now plus `validity`
/// (shared by the CA and its leaves).
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
