//! The rustls client configuration for connections sluice makes upstream.
//!
//! This module owns which roots sluice trusts when it talks TLS to a receiver
//! (system roots plus operator-supplied PEM files), and turns failed upstream
//! handshakes into short, log-friendly reasons ([`describe_failure`]).
//! Hostname and chain are always verified with rustls' default WebPKI verifier.

use std::fs::File;
use std::io::{self, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::{CertificateError, ClientConfig, RootCertStore};

/// Errors building the upstream TLS trust.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamTlsError {
    /// An extra root file could not be opened or read.
    #[error(
        "cannot read extra root certificate file {path}: {source} — check the path and its permissions"
    )]
    Io {
        /// The file sluice tried to read.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: io::Error,
    },
    /// An extra root file is not valid PEM.
    #[error(
        "extra root certificate file {path} is not valid PEM: {reason} — it must contain `-----BEGIN CERTIFICATE-----` blocks"
    )]
    BadPem {
        /// The offending file.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// An extra root file holds no certificate at all.
    #[error(
        "extra root certificate file {path} contains no certificate — it must contain at least one `-----BEGIN CERTIFICATE-----` block"
    )]
    NoCertificate {
        /// The offending file.
        path: PathBuf,
    },
    /// A certificate in an extra root file cannot be used as a trust anchor.
    #[error("certificate #{index} in {path} cannot be used as a trusted root: {reason}")]
    BadRoot {
        /// The file holding the certificate.
        path: PathBuf,
        /// 1-based position of the certificate in the file.
        index: usize,
        /// Why rustls refused it.
        reason: String,
    },
    /// rustls refused the configuration itself (should not happen with the ring provider).
    #[error("cannot build the upstream TLS configuration: {0}")]
    Config(#[source] rustls::Error),
}

/// Builds the client config for upstream connections.
///
/// Trusts the system roots (via `rustls-native-certs`, which honours `SSL_CERT_FILE` /
/// `SSL_CERT_DIR`; unparsable system certificates are skipped and a system without any
/// roots is accepted) plus every PEM certificate in each of `extra_roots` (an error names
/// the file if it is unreadable, not PEM, or holds no certificate). Hostname and chain are
/// always verified with the default WebPKI verifier. ALPN is `["http/1.1"]`; the caller
/// may change `alpn_protocols`.
///
/// Loading system roots reads files: call this once (at start-up or reload), not per
/// connection, and share the result in an `Arc`.
pub fn client_config(extra_roots: &[PathBuf]) -> Result<ClientConfig, UpstreamTlsError> {
    let mut roots = RootCertStore::empty();

    let native = rustls_native_certs::load_native_certs();
    for err in &native.errors {
        tracing::warn!(error = %err, "skipping unreadable system root certificate(s)");
    }
    let (added, ignored) = roots.add_parsable_certificates(native.certs);
    if ignored > 0 {
        tracing::debug!(
            ignored,
            "skipped system root certificates rustls cannot use"
        );
    }
    tracing::debug!(added, "loaded system root certificates");

    for path in extra_roots {
        let certs = read_pem_certs(path)?;
        let count = certs.len();
        for (i, cert) in certs.into_iter().enumerate() {
            roots.add(cert).map_err(|e| UpstreamTlsError::BadRoot {
                path: path.clone(),
                index: i + 1,
                reason: e.to_string(),
            })?;
        }
        tracing::debug!(path = %path.display(), count, "loaded extra root certificates");
    }

    if roots.is_empty() {
        tracing::warn!(
            "no trusted root certificates (no system roots and no extra roots): every upstream TLS connection will fail with \"unknown issuer\""
        );
    }

    let provider = Arc::new(super::crypto_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(UpstreamTlsError::Config)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Reads every `CERTIFICATE` block of a PEM file; at least one is required.
fn read_pem_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, UpstreamTlsError> {
    let file = File::open(path).map_err(|source| UpstreamTlsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(file))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => UpstreamTlsError::BadPem {
                path: path.to_path_buf(),
                reason: e.to_string(),
            },
            _ => UpstreamTlsError::Io {
                path: path.to_path_buf(),
                source: e,
            },
        })?;
    if certs.is_empty() {
        return Err(UpstreamTlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// Turns the error of a failed upstream TLS handshake into a short reason for logs.
///
/// Walks the [`std::error::Error::source`] chain (looking inside `std::io::Error`s too,
/// whose `source()` skips the wrapped error) for a [`rustls::Error`] and names the common
/// certificate failures: `"unknown issuer"`, `"certificate expired"`,
/// `"certificate not valid for name <x>"` (plus the names the certificate is for, when
/// rustls reports them), … If no rustls error is found, returns the chain's messages joined
/// with `": "`.
pub fn describe_failure(err: &(dyn std::error::Error + 'static)) -> String {
    if let Some(tls) = find_rustls(err) {
        return describe_rustls(tls);
    }
    let mut texts: Vec<String> = Vec::new();
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && !texts.last().is_some_and(|prev| prev.contains(&text)) {
            texts.push(text);
        }
        next = e.source();
    }
    if texts.is_empty() {
        "unknown TLS failure".to_owned()
    } else {
        texts.join(": ")
    }
}

/// The first [`rustls::Error`] in `err`'s source chain, also looking inside
/// `std::io::Error`s (whose `source()` skips the error they wrap).
pub fn find_rustls<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next: Option<&'a (dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = e.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            let inner: &'a (dyn std::error::Error + 'static) = inner;
            if let Some(tls) = find_rustls(inner) {
                return Some(tls);
            }
        }
        next = e.source();
    }
    None
}

fn describe_rustls(err: &rustls::Error) -> String {
    match err {
        rustls::Error::InvalidCertificate(cert) => describe_certificate(cert),
        rustls::Error::AlertReceived(alert) => format!("server sent TLS alert {alert:?}"),
        rustls::Error::NoCertificatesPresented => "server presented no certificate".to_owned(),
        other => other.to_string(),
    }
}

fn describe_certificate(err: &CertificateError) -> String {
    match err {
        CertificateError::UnknownIssuer => "unknown issuer: the certificate does not chain to the \
             system roots or tls.upstream_roots (a receiver with a private CA or a self-signed \
             certificate: list it in tls.upstream_roots)"
            .to_owned(),
        CertificateError::UnsupportedSignatureAlgorithmContext { .. }
        | CertificateError::UnsupportedSignatureAlgorithmForPublicKeyContext { .. } => {
            "certificate signed with an algorithm its issuer's key does not allow (a \
             self-signed certificate not listed in tls.upstream_roots is read this way)"
                .to_owned()
        }
        // webpki's `CaUsedAsEndEntity`, which rustls passes on as an opaque error.
        CertificateError::Other(other) if format!("{other:?}").contains("CaUsedAsEndEntity") => {
            "the receiver's certificate is a CA certificate (basicConstraints CA:TRUE, as \
             `openssl req -x509` makes by default), which TLS does not accept as a server's \
             own even when listed in tls.upstream_roots: re-issue it with CA:FALSE, or sign it \
             with a CA and list that CA"
                .to_owned()
        }
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            "certificate expired".to_owned()
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "certificate not yet valid".to_owned()
        }
        CertificateError::NotValidForName => "certificate not valid for name".to_owned(),
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => {
            if presented.is_empty() {
                format!("certificate not valid for name {}", expected.to_str())
            } else {
                format!(
                    "certificate not valid for name {} (it is for {})",
                    expected.to_str(),
                    presented.join(", ")
                )
            }
        }
        CertificateError::Revoked => "certificate revoked".to_owned(),
        CertificateError::BadSignature => "bad certificate signature".to_owned(),
        CertificateError::BadEncoding => "malformed certificate".to_owned(),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            "certificate not valid for server authentication".to_owned()
        }
        other => rustls::Error::InvalidCertificate(other.clone()).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{CertAuthority, Interceptor, generate_ca};
    use rustls::pki_types::ServerName;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn interceptor(dir: &Path) -> Interceptor {
        let files = generate_ca(dir).unwrap();
        let ca = CertAuthority::load(&files.cert, &files.key).unwrap();
        Interceptor::new(ca, 10, Duration::from_secs(3600))
    }

    /// Serves `server_config(leaf_host)` on one side of a duplex, connects a client
    /// asking for `sni` with `config`, and returns the client's result.
    async fn connect(
        icpt: &Interceptor,
        leaf_host: &str,
        sni: &str,
        config: ClientConfig,
    ) -> Result<(), io::Error> {
        connect_to(icpt.server_config(leaf_host).unwrap(), sni, config).await
    }

    /// Serves `server_cfg` on one side of a duplex, connects a client asking for `sni`
    /// with `config`, and returns the client's result.
    async fn connect_to(
        server_cfg: Arc<rustls::ServerConfig>,
        sni: &str,
        config: ClientConfig,
    ) -> Result<(), io::Error> {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let acceptor = tokio_rustls::TlsAcceptor::from(server_cfg);
        let server = async move {
            if let Ok(mut s) = acceptor.accept(server_io).await {
                let _ = s.write_all(b"x").await;
                let _ = s.shutdown().await;
            }
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = ServerName::try_from(sni.to_owned()).unwrap();
        let client = async move {
            let mut s = connector.connect(name, client_io).await?;
            let mut buf = [0u8; 1];
            s.read_exact(&mut buf).await?;
            Ok(())
        };
        let ((), res) = tokio::join!(server, client);
        res
    }

    /// Upstream, sluice offers AES-128-GCM-SHA256 first: a receiver that follows the
    /// client's order (rustls' and OpenSSL's default) negotiates it.
    #[tokio::test]
    async fn sluice_offers_aes_128_gcm_first_upstream() {
        let dir = tempfile::tempdir().unwrap();
        let icpt = interceptor(dir.path());
        let mut server_cfg = (*icpt.server_config("localhost").unwrap()).clone();
        server_cfg.ignore_client_order = false;
        let config = client_config(&[dir.path().join("ca.pem")]).unwrap();
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_cfg));
        let server = async move {
            let mut s = acceptor.accept(server_io).await.unwrap();
            s.write_all(b"x").await.unwrap();
            s.flush().await.unwrap();
            s.get_ref().1.negotiated_cipher_suite().map(|s| s.suite())
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = ServerName::try_from("localhost").unwrap();
        let client = async move {
            let mut s = connector.connect(name, client_io).await.unwrap();
            let mut buf = [0u8; 1];
            s.read_exact(&mut buf).await.unwrap();
        };
        let (suite, ()) = tokio::join!(server, client);
        assert_eq!(suite, Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
    }

    #[tokio::test]
    async fn wrong_name_is_described() {
        let dir = tempfile::tempdir().unwrap();
        let icpt = interceptor(dir.path());
        let config = client_config(&[dir.path().join("ca.pem")]).unwrap();
        connect(&icpt, "a.example.com", "a.example.com", config.clone())
            .await
            .unwrap();
        let err = connect(&icpt, "a.example.com", "b.example.com", config)
            .await
            .unwrap_err();
        let reason = describe_failure(&err);
        assert!(reason.contains("not valid for name"), "{reason}");
        assert!(reason.contains("b.example.com"), "{reason}");
    }

    #[tokio::test]
    async fn unknown_issuer_is_described() {
        let dir = tempfile::tempdir().unwrap();
        let icpt = interceptor(dir.path());
        let config = client_config(&[]).unwrap();
        let err = connect(&icpt, "a.example.com", "a.example.com", config)
            .await
            .unwrap_err();
        let reason = describe_failure(&err);
        assert!(reason.starts_with("unknown issuer"), "{reason}");
        assert!(reason.contains("tls.upstream_roots"), "{reason}");
    }

    /// A receiver serving a self-signed CA:TRUE certificate (what
    /// `openssl req -x509` makes) is refused even when it is listed; the reason says why
    /// and what to do, not `Other(OtherError(CaUsedAsEndEntity))`.
    #[tokio::test]
    async fn a_ca_certificate_served_as_the_receivers_own_is_explained() {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let pem = dir.path().join("self.pem");
        std::fs::write(&pem, cert.pem()).unwrap();
        let server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let config = client_config(&[pem]).unwrap();
        let err = connect_to(Arc::new(server), "localhost", config)
            .await
            .unwrap_err();
        let reason = describe_failure(&err);
        assert!(reason.contains("CA:FALSE"), "{reason}");
    }

    #[test]
    fn describe_walks_wrapped_errors() {
        #[derive(Debug)]
        struct Outer(io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("client error (Connect)")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let tls = rustls::Error::InvalidCertificate(CertificateError::Expired);
        let io_err = io::Error::new(io::ErrorKind::InvalidData, tls);
        let outer = Outer(io::Error::other(io_err));
        assert_eq!(describe_failure(&outer), "certificate expired");

        let plain = Outer(io::Error::new(io::ErrorKind::ConnectionRefused, "refused"));
        assert_eq!(describe_failure(&plain), "client error (Connect): refused");
    }

    #[test]
    fn extra_root_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err = client_config(std::slice::from_ref(&missing)).unwrap_err();
        assert!(matches!(err, UpstreamTlsError::Io { .. }));
        assert!(err.to_string().contains("missing.pem"), "{err}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = client_config(std::slice::from_ref(&empty)).unwrap_err();
        assert!(matches!(err, UpstreamTlsError::NoCertificate { .. }));
        assert!(err.to_string().contains("empty.pem"), "{err}");

        let bad = dir.path().join("bad.pem");
        std::fs::write(
            &bad,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = client_config(std::slice::from_ref(&bad)).unwrap_err();
        assert!(err.to_string().contains("bad.pem"), "{err}");
    }

    #[test]
    fn alpn_is_http1() {
        let config = client_config(&[]).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
