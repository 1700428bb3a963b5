//! A real HTTPS upstream with its own test CA, made in the test with rcgen.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;

use super::{Arrival, Reply, Responder};

/// A test CA and a leaf it signed for `names`.
pub struct TestPki {
    pub ca_pem: String,
    pub leaf: CertificateDer<'static>,
    pub leaf_key: Vec<u8>,
}

impl TestPki {
    /// A TLS acceptor serving the leaf, offering HTTP/1.1 only.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![self.leaf.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone())),
            )
            .unwrap();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
    }

    pub fn new(names: &[&str]) -> TestPki {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "upstream test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let leaf = CertificateParams::new(names)
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        TestPki {
            ca_pem: ca_cert.pem(),
            leaf: leaf.der().clone(),
            leaf_key: leaf_key.serialize_der(),
        }
    }

    pub fn write_ca(&self, dir: &Path) -> PathBuf {
        let p = dir.join("upstream-ca.pem");
        std::fs::write(&p, &self.ca_pem).unwrap();
        p
    }
}

/// An HTTPS upstream serving `pki`'s leaf, recording arrivals like [`super::Upstream`].
pub struct TlsUpstream {
    pub addr: SocketAddr,
    pub arrivals: Arc<Mutex<Vec<Arrival>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsUpstream {
    pub async fn start(pki: &TestPki, responder: Responder) -> TlsUpstream {
        let acceptor = pki.acceptor();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let responder = Arc::new(Mutex::new(responder));
        let a = Arc::clone(&arrivals);
        let task = tokio::spawn(async move {
            for conn in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, a, r) = (acceptor.clone(), Arc::clone(&a), Arc::clone(&responder));
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let svc = service_fn(move |req| {
                        super::serve(req, conn, Arc::clone(&a), Arc::clone(&r))
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        TlsUpstream {
            addr,
            arrivals,
            task,
        }
    }

    pub async fn ok(pki: &TestPki) -> TlsUpstream {
        TlsUpstream::start(pki, Arc::new(|_| Reply::ok())).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("https://localhost:{}{}", self.addr.port(), path)
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().unwrap().clone()
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A sender's HTTP/1.1 session inside an intercepted tunnel: `CONNECT authority`
/// through the proxy at `proxy`, then TLS naming `server_name` (ALPN `http/1.1`),
/// trusting only the CA certificate in the PEM file `ca`. Panics if the proxy refuses.
#[allow(dead_code)]
pub async fn tunnel_session(
    proxy: SocketAddr,
    ca: &Path,
    authority: &str,
    server_name: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let connect = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    tcp.write_all(connect.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(tcp.read(&mut b).await.unwrap(), 1, "{head:?}");
        head.push(b[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    let cfg = http11_client(ca);
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned()).unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .unwrap()
}

/// A TLS client offering ALPN `http/1.1` that trusts only the CA certificate in the PEM
/// file `ca`.
#[allow(dead_code)]
pub fn http11_client(ca: &Path) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut std::fs::read(ca).unwrap().as_slice()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    cfg
}
