//! HTTPS through sluice: interception with sluice's CA (each request paced, 429s heard),
//! passthrough tunnels, upstream certificate verification, the leaf cache bound.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use common::tls::{TestPki, TlsUpstream};
use common::{Reply, assert_no_overdraw, sustained_rate};

use common::process::RunWithin;

/// Longest any child process (curl, the sluice binary) may run before the test fails.
const CHILD_DEADLINE: Duration = Duration::from_secs(30);

struct Setup {
    dir: tempfile::TempDir,
    sluice_ca: std::path::PathBuf,
    upstream_ca: std::path::PathBuf,
    pki: TestPki,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let files = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let pki = TestPki::new(&["localhost"]);
    let upstream_ca = pki.write_ca(dir.path());
    Setup {
        sluice_ca: files.cert,
        upstream_ca,
        pki,
        dir,
    }
}

impl Setup {
    fn tls_config(&self, extra: &str) -> String {
        format!(
            "[tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n{extra}",
            self.sluice_ca.display(),
            self.dir.path().join("ca/ca.key").display(),
            self.upstream_ca.display(),
        )
    }

    /// reqwest with sluice as HTTPS proxy, trusting `ca`.
    fn client(&self, proxy: std::net::SocketAddr, ca: &std::path::Path) -> reqwest::Client {
        let pem = std::fs::read(ca).unwrap();
        reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .proxy(reqwest::Proxy::https(format!("http://{proxy}")).unwrap())
            .http1_only()
            .pool_max_idle_per_host(1)
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap()
    }
}

#[tokio::test]
async fn intercepted_requests_are_paced_one_by_one_over_one_tunnel() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let (rate, burst) = (20.0, 2.0);
    let s = common::sluice(&format!(
        "[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n{}",
        st.tls_config("")
    ))
    .await;
    let c = st.client(s.proxy_addr, &st.sluice_ca);
    for i in 0..40 {
        let r = c
            .get(up.url(&format!("/t/{i}")))
            .header("x-endpoint-id", "tls-ep")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("x-sluice-reason").is_none());
    }
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), 40);
    for a in &arrivals {
        assert!(
            !a.headers.contains_key("x-endpoint-id"),
            "the endpoint header reached the upstream"
        );
    }
    let times: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
    assert_no_overdraw(&times, rate, burst);
    let achieved = sustained_rate(&times, burst as usize);
    assert!(achieved >= 0.95 * rate, "{achieved:.1}/s");
    let metrics = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("sluice_requests_total{endpoint=\"tls-ep\",outcome=\"forwarded\"} 40"),
        "{metrics}"
    );
    s.stop().await;
}

// curl blocks its thread: keep a second worker serving sluice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_through_interception() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let s = common::sluice(&st.tls_config("")).await;
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--proxy"])
        .arg(format!("http://{}", s.proxy_addr))
        .arg("--cacert")
        .arg(&st.sluice_ca)
        .args(["-H", "X-Endpoint-Id: curl-ep", "-w", " %{http_code}"])
        .arg(up.url("/curl"))
        .run_within(CHILD_DEADLINE);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.ends_with(" 200"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(up.arrivals()[0].path, "/curl");
    s.stop().await;
}

// curl blocks its thread: keep a second worker serving sluice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_senders_get_each_stream_paced_over_one_multiplexed_tunnel() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let (rate, burst) = (10.0, 1.0);
    let s = common::sluice(&format!(
        "[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n{}",
        st.tls_config("")
    ))
    .await;
    // Twelve streams, multiplexed over one HTTP/2 connection by curl --parallel.
    let n = 12;
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "20", "--http2", "--parallel"])
        .args(["--parallel-max", "12", "--proxy"])
        .arg(format!("http://{}", s.proxy_addr))
        .arg("--cacert")
        .arg(&st.sluice_ca)
        .args(["-H", "X-Endpoint-Id: h2-ep"])
        .args(["-w", "%{http_version} %{http_code} %{num_connects}\n"]);
    for i in 0..n {
        cmd.args(["-o", "/dev/null"])
            .arg(up.url(&format!("/h2/{i}")));
    }
    let out = cmd.run_within(CHILD_DEADLINE);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        n,
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for l in &lines {
        assert!(l.starts_with("2 200 "), "not HTTP/2 200: {l}\n{stdout}");
    }
    let connects: u32 = lines
        .iter()
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u32>().unwrap())
        .sum();
    assert_eq!(connects, 1, "not one multiplexed tunnel:\n{stdout}");
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), n, "every stream arrives exactly once");
    for a in &arrivals {
        assert!(!a.headers.contains_key("x-endpoint-id"));
    }
    let times: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
    assert_no_overdraw(&times, rate, burst);
    // Paced one by one: twelve streams at 10/s with a burst of 1 take over a second.
    let span = times
        .iter()
        .max()
        .unwrap()
        .duration_since(*times.iter().min().unwrap());
    assert!(span >= Duration::from_millis(1000), "{span:?}");
    s.stop().await;
}

#[tokio::test]
async fn a_429_inside_tls_starts_the_cooldown() {
    let st = setup();
    let fired = Arc::new(AtomicUsize::new(0));
    let up = TlsUpstream::start(
        &st.pki,
        Arc::new(move |a| {
            if a.path == "/trigger" && fired.fetch_add(1, Ordering::SeqCst) == 0 {
                Reply::status(429).header("retry-after", "2")
            } else {
                Reply::ok()
            }
        }),
    )
    .await;
    // The 429 reaches the sender (absorb off): the cooldown it starts is what is watched.
    let s = common::sluice(&format!(
        "[defaults]\nmax_wait = \"10s\"\n[defaults.adaptive]\nabsorb = \"off\"\n{}",
        st.tls_config("")
    ))
    .await;
    let c = st.client(s.proxy_addr, &st.sluice_ca);
    let r = c
        .get(up.url("/trigger"))
        .header("x-endpoint-id", "tls429")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let t0 = Instant::now();
    let r = c
        .get(up.url("/after"))
        .header("x-endpoint-id", "tls429")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let after = up
        .arrivals()
        .iter()
        .find(|a| a.path == "/after")
        .unwrap()
        .at;
    assert!(
        after - t0 >= Duration::from_millis(1990),
        "sent {:?} into a 2 s cooldown",
        after - t0
    );
    s.stop().await;
}

#[tokio::test]
async fn passthrough_hosts_tunnel_end_to_end_with_the_upstreams_own_ca() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let s = common::sluice(&st.tls_config("passthrough_hosts = [\"local*\"]\n")).await;
    // The client trusts only the upstream's CA: interception would fail, a tunnel works.
    let c = st.client(s.proxy_addr, &st.upstream_ca);
    let r = c.get(up.url("/through")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.arrivals()[0].path, "/through");
    // Close the client's pooled tunnel: shutdown would otherwise wait its grace for it.
    drop((r, c));
    s.stop().await;
}

// curl blocks its thread: keep a second worker serving sluice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_proxy_user_names_the_endpoint_of_a_passthrough_tunnel() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let s = common::sluice(&format!(
        "[proxy]\nendpoint_from_proxy_user = true\n[defaults]\nrate = 0.05\nburst = 1.0\nmax_wait = \"0s\"\n{}",
        st.tls_config("passthrough_hosts = [\"localhost\"]\n")
    ))
    .await;
    let curl = |path: &str| {
        Command::new("curl")
            .args(["-sS", "--max-time", "10", "--proxy"])
            .arg(format!("http://ep_x@{}", s.proxy_addr))
            .arg("--cacert")
            .arg(&st.upstream_ca)
            .args(["-w", " %{http_code}"])
            .arg(up.url(path))
            .run_within(CHILD_DEADLINE)
    };
    let first = curl("/one");
    assert!(
        String::from_utf8_lossy(&first.stdout).ends_with(" 200"),
        "{first:?}"
    );
    // A second tunnel under ep_x finds the bucket empty: refused at CONNECT, nothing sent.
    let second = curl("/two");
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("503"),
        "{second:?}"
    );
    assert_eq!(up.arrivals().len(), 1);
    let eps: serde_json::Value = reqwest::get(format!("http://{}/endpoints", s.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        eps.as_array().unwrap().iter().any(|e| e["id"] == "ep_x"),
        "{eps}"
    );
    s.stop().await;
}

#[tokio::test]
async fn an_upstream_certificate_for_the_wrong_name_is_a_502() {
    let st = setup();
    let wrong = TestPki::new(&["not-localhost.test"]);
    std::fs::write(&st.upstream_ca, &wrong.ca_pem).unwrap();
    let up = TlsUpstream::ok(&wrong).await;
    let s = common::sluice(&st.tls_config("")).await;
    let c = st.client(s.proxy_addr, &st.sluice_ca);
    let r = c.get(up.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["x-sluice-reason"], "upstream_error");
    let body = r.text().await.unwrap();
    assert!(
        body.contains("not valid for name") || body.contains("NotValidForName"),
        "{body}"
    );
    assert!(up.arrivals().is_empty());
    s.stop().await;
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_ca_fails_its_handshake() {
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let s = common::sluice(&st.tls_config("handshake_timeout = \"300ms\"")).await;
    let c = st.client(s.proxy_addr, &st.upstream_ca);
    // Failing is not enough (a refused CONNECT fails too): it must be the certificate.
    let err = c.get(up.url("/")).send().await.unwrap_err();
    let chain = format!("{err:?}");
    assert!(
        chain.contains("UnknownIssuer") || chain.contains("certificate"),
        "failed, but not on sluice's certificate: {chain}"
    );
    // The same client trusting sluice's CA gets through: the setup itself works.
    let trusting = st.client(s.proxy_addr, &st.sluice_ca);
    assert_eq!(
        trusting.get(up.url("/ok")).send().await.unwrap().status(),
        200
    );
    let paths: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert_eq!(paths, ["/ok"], "nothing from the untrusting client arrived");
    // A sender that opens a tunnel and never starts its handshake.
    let mut silent = tokio::net::TcpStream::connect(s.proxy_addr).await.unwrap();
    let connect = format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", up.addr);
    tokio::io::AsyncWriteExt::write_all(&mut silent, connect.as_bytes())
        .await
        .unwrap();
    // An operator sees each way an intercepted
    // handshake ends without reading logs: a fleet that does not trust the CA shows as
    // handshake_failed.
    for (result, n) in [
        ("established", 1),
        ("handshake_failed", 1),
        ("handshake_timeout", 1),
    ] {
        common::wait_for_metric(
            s.admin_addr,
            &format!("sluice_intercepted_tunnels_total{{result=\"{result}\"}} {n}\n"),
        )
        .await;
    }
    drop(silent);
    s.stop().await;
}

#[tokio::test]
async fn the_leaf_cache_stays_within_its_bound() {
    let st = setup();
    let s = common::sluice(&st.tls_config("leaf_cache_size = 10\n")).await;
    let pem = std::fs::read(&st.sluice_ca).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pem.as_slice()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for i in 0..40 {
        let host = format!("h{i}.example.test");
        let mut tcp = tokio::net::TcpStream::connect(s.proxy_addr).await.unwrap();
        tcp.write_all(
            format!("CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = [0u8; 256];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        let name = rustls::pki_types::ServerName::try_from(host.clone()).unwrap();
        connector
            .connect(name, tcp)
            .await
            .expect("the minted leaf verifies against sluice's CA");
    }
    let cached = s.app.interceptor.as_ref().unwrap().cached_hosts();
    // Bounded and still used: 40 hosts minted one after another leave exactly the last 10
    // (`<= 10` alone would also hold for a cache that keeps nothing).
    assert_eq!(cached, 10, "{cached} leaves cached with a bound of 10");
    s.stop().await;
}

/// An HTTP/2 sender that stops taking a response (its stream window shut) while it
/// keeps the connection busy with PINGs does not hold the endpoint's `max_in_flight`
/// slot for ever: after `idle_timeout` untaken, sluice takes the body from it, reads the
/// rest for the receiver and frees the slot, so the endpoint's other senders do not get
/// 503 `concurrency_limited` for as long as that sender likes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_sender_that_stops_reading_frees_its_slot_after_idle_timeout() {
    let st = setup();
    // 4 MB: far more than the stream window and the buffers on the way.
    let big: String = "x".repeat(4 << 20);
    let up = TlsUpstream::start(
        &st.pki,
        Arc::new(move |_| common::Reply {
            body: big.clone(),
            ..common::Reply::ok()
        }),
    )
    .await;
    let s = common::sluice(&format!(
        "[proxy]\nidle_timeout = \"1s\"\n\
         [defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 1\n{}",
        st.tls_config("")
    ))
    .await;
    let pem = std::fs::read(&st.sluice_ca).unwrap();
    let h2 = |pings: bool| {
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .proxy(reqwest::Proxy::https(format!("http://{}", s.proxy_addr)).unwrap())
            .timeout(Duration::from_secs(30));
        if pings {
            b = b
                .http2_keep_alive_interval(Duration::from_millis(200))
                .http2_keep_alive_while_idle(true);
        }
        b.build().unwrap()
    };
    let stalled = h2(true);
    let r = stalled
        .get(up.url("/stalled"))
        .header("x-endpoint-id", "h2-slot")
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    // Its body is never read; the PINGs keep the connection alive.
    let started = Instant::now();
    let next = h2(false)
        .get(up.url("/next"))
        .header("x-endpoint-id", "h2-slot")
        .send()
        .await
        .unwrap();
    assert_eq!(
        next.status(),
        200,
        "{:?}",
        next.headers().get("x-sluice-reason")
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the slot came back after {:?}",
        started.elapsed()
    );
    drop(r);
    s.stop().await;
}

/// Inside an intercepted tunnel too, a head no HTTP/1.1
/// server would read gets sluice's own refusal (the lane reads those heads), and the
/// TLS session then ends.
#[tokio::test]
async fn a_malformed_head_inside_an_intercepted_tunnel_gets_a_clear_refusal() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let st = setup();
    let up = TlsUpstream::ok(&st.pki).await;
    let s = common::sluice(&st.tls_config("")).await;
    let url = up.url("/");
    let authority = url
        .strip_prefix("https://")
        .and_then(|u| u.strip_suffix('/'))
        .unwrap();
    let mut tls =
        common::tls::tunnel_session(s.proxy_addr, &st.sluice_ca, authority, "localhost").await;
    tls.write_all(b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut answer));
    assert!(read.await.is_ok(), "the session did not end");
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 400 "), "{answer}");
    assert!(answer.contains("x-sluice-reason: bad_request"), "{answer}");
    assert!(answer.contains("malformed request head"), "{answer}");
    assert!(up.arrivals().is_empty(), "nothing reached the receiver");
    s.stop().await;
}
