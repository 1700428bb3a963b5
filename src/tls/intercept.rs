//! Terminating the client side of an intercepted CONNECT tunnel.
//!
//! This module owns the [`Interceptor`]: it reads the ClientHello, picks the host (SNI,
//! else the CONNECT authority), presents a leaf for it from the cache in
//! [`super::leaf`] (minting one with the [`CertAuthority`] on a miss), and turns a failed
//! handshake into one line naming the host and the fix ([`Interceptor::accept`]).

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::crypto::CryptoProvider;
use rustls::{AlertDescription, ServerConfig};

use super::MitmError;
use super::ca::CertAuthority;
use super::leaf::{self, Host, LeafCache, MAX_LEAF_VALIDITY, MIN_LEAF_VALIDITY};

/// Terminates intercepted CONNECT tunnels with freshly minted per-host leaves.
///
/// `Send + Sync`: share one instance via `Arc` across connections.
pub struct Interceptor {
    ca: CertAuthority,
    provider: Arc<CryptoProvider>,
    validity: Duration,
    cache: LeafCache<Arc<ServerConfig>>,
}

impl fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Interceptor")
            .field("ca", &self.ca)
            .field("capacity", &self.cache.capacity())
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
            provider: Arc::new(super::crypto_provider()),
            validity: validity.clamp(MIN_LEAF_VALIDITY, MAX_LEAF_VALIDITY),
            cache: LeafCache::new(capacity),
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
        if let Some(config) = self.cache.get(&key) {
            return Ok(config);
        }
        // Mint outside the lock; if another thread won the race, use its config.
        let minted_at = Instant::now();
        let (chain, leaf_key) = self.ca.mint(&parsed, self.validity).map_err(mint_error)?;
        let config =
            leaf::server_config(self.provider.clone(), chain, leaf_key).map_err(mint_error)?;
        let refresh_at = minted_at + self.validity - self.validity / 4;
        Ok(self.cache.insert(key, Arc::new(config), refresh_at))
    }

    /// Number of hosts currently cached.
    pub fn cached_hosts(&self) -> usize {
        self.cache.len()
    }

    /// Terminates TLS on `io`, a client connection already past the `CONNECT` 200.
    ///
    /// Reads the ClientHello and completes the handshake with
    /// [`server_config`](Self::server_config) for `authority_host` (the CONNECT target
    /// host, without port). A ClientHello whose SNI names another host (compared without
    /// case, a trailing dot or IPv6 brackets) is refused. Returns the stream and
    /// `authority_host`. A failed handshake gives [`MitmError::Handshake`] naming the
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
        // The leaf is for the host the tunnel goes to: a ClientHello naming another host
        // would get a certificate for a host the CONNECT never asked (and was never
        // checked) for.
        if let Some(sni) = start.client_hello().server_name() {
            if !same_host(sni, authority_host) {
                return Err(MitmError::Handshake {
                    host: authority_host.to_owned(),
                    reason: format!(
                        "the client's TLS server name {sni:?} is not the CONNECT host; refused"
                    ),
                });
            }
        }
        let host = authority_host.to_owned();
        let config = self.server_config(&host)?;
        let stream = start
            .into_stream(config)
            .await
            .map_err(|e| self.handshake_error(&host, &e))?;
        Ok((stream, host))
    }

    /// One line saying why the handshake with the client failed and what to do.
    fn handshake_error(&self, host: &str, err: &io::Error) -> MitmError {
        let trust = format!("make the client trust {}", self.ca.cert_path().display());
        let reason = match super::upstream::find_rustls(err) {
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
                "client offered no ALPN protocol sluice supports (intercepted tunnels speak h2 and http/1.1)".to_owned()
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

/// Whether an SNI name and a CONNECT host name the same host: without case, a trailing
/// dot or IPv6 brackets.
fn same_host(sni: &str, authority_host: &str) -> bool {
    let bare = |h: &str| {
        let h = h.strip_suffix('.').unwrap_or(h);
        h.strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(h)
            .to_ascii_lowercase()
    };
    bare(sni) == bare(authority_host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::generate_ca;
    use crate::tls::upstream::client_config;
    use rustls::pki_types::{CertificateDer, ServerName};
    use rustls::server::ParsedCertificate;
    use std::path::Path;
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
    fn unparsable_host_is_a_mint_error() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 4, Duration::from_secs(3600));
        let err = icpt.server_config("exa mple.com").unwrap_err();
        assert!(matches!(err, MitmError::Mint { .. }));
        assert!(err.to_string().contains("exa mple.com"), "{err}");
    }

    struct Handshake {
        server: Result<(String, Vec<u8>), MitmError>,
        client: Result<(Vec<CertificateDer<'static>>, Option<Vec<u8>>), io::Error>,
        /// The suite the client's side negotiated.
        suite: Option<rustls::CipherSuite>,
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
        let mut suite = None;
        let client = async {
            let mut tls = connector.connect(name, client_io).await?;
            tls.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            tls.read_exact(&mut buf).await?;
            assert_eq!(&buf, b"pong");
            let conn = tls.get_ref().1;
            suite = conn.negotiated_cipher_suite().map(|s| s.suite());
            let certs = conn.peer_certificates().unwrap_or_default().to_vec();
            Ok((certs, conn.alpn_protocol().map(<[u8]>::to_vec)))
        };
        let (server, client) = tokio::join!(server, client);
        Handshake {
            server,
            client,
            suite,
        }
    }

    /// A client config trusting the CA in `dir`, offering only `suites`, in that order
    /// (rustls' own provider, as a sender's TLS stack would be).
    fn offering(dir: &Path, suites: &[rustls::CipherSuite]) -> rustls::ClientConfig {
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = suites
            .iter()
            .map(|want| {
                *provider
                    .cipher_suites
                    .iter()
                    .find(|s| s.suite() == *want)
                    .unwrap()
            })
            .collect();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(
                rustls_pemfile::certs(&mut &std::fs::read(dir.join("ca.pem")).unwrap()[..])
                    .next()
                    .unwrap()
                    .unwrap(),
            )
            .unwrap();
        rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth()
    }

    /// A sender whose TLS prefers AES-256-GCM-SHA384 (OpenSSL's and rustls' order) gets
    /// AES-128-GCM-SHA256, whose handshake costs sluice less, in TLS 1.3 and 1.2; one
    /// that does not offer it gets a suite it offers.
    #[tokio::test]
    async fn senders_get_aes_128_gcm_first_and_otherwise_a_suite_they_offer() {
        use rustls::CipherSuite::{
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 as ECDSA_AES128_GCM,
            TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 as ECDSA_AES256_GCM,
            TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 as ECDSA_CHACHA,
            TLS13_AES_128_GCM_SHA256 as AES128, TLS13_AES_256_GCM_SHA384 as AES256,
            TLS13_CHACHA20_POLY1305_SHA256 as CHACHA,
        };
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 16, Duration::from_secs(3600));
        for (offered, expect) in [
            (&[AES256, AES128, CHACHA][..], AES128),
            (&[CHACHA, AES256, AES128][..], AES128),
            (&[AES256, CHACHA][..], AES256),
            (&[CHACHA][..], CHACHA),
            // A TLS 1.2-only sender (its suites for the leaf's ECDSA key).
            (&[ECDSA_AES256_GCM, ECDSA_AES128_GCM][..], ECDSA_AES128_GCM),
            (&[ECDSA_CHACHA][..], ECDSA_CHACHA),
        ] {
            let name = ServerName::try_from("api.example.com").unwrap();
            let config = offering(tmp.path(), offered);
            let hs = handshake(&icpt, "api.example.com", name, config).await;
            hs.server.unwrap();
            hs.client.unwrap();
            assert_eq!(hs.suite, Some(expect), "offered {offered:?}");
        }
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
            // The SNI names the CONNECT host (case and a trailing dot aside).
            ("api.example.com", "API.example.com.", "api.example.com"),
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
            let (_, parsed) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
            assert!(!parsed.is_ca());
        }
        assert_eq!(icpt.cached_hosts(), 3);
    }

    /// Hardening finding 11: a client cannot get a leaf for a host other than the one
    /// its CONNECT named (and the destination policy checked).
    #[tokio::test]
    async fn an_sni_naming_another_host_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let icpt = Interceptor::new(new_ca(tmp.path()), 16, Duration::from_secs(3600));
        let config = trusting_config(tmp.path());
        let name = ServerName::try_from("bank.example").unwrap();
        let hs = handshake(&icpt, "allowed.example", name, config).await;
        assert!(hs.client.is_err(), "the client got a certificate");
        let err = hs.server.unwrap_err();
        assert!(matches!(err, MitmError::Handshake { .. }), "{err}");
        assert!(err.to_string().contains("bank.example"), "{err}");
        assert_eq!(icpt.cached_hosts(), 0, "no leaf was minted");
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
        icpt.cache.expire("a.example");
        let second = icpt.server_config("a.example").unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(icpt.cached_hosts(), 1);
        assert!(Arc::ptr_eq(
            &second,
            &icpt.server_config("a.example").unwrap()
        ));
    }
}
