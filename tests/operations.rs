//! Operating sluice: the metrics contract, the endpoint label cap, live reload under
//! load, `sluice status`, and secrets kept out of logs. Drives the real binary where
//! signals and logs matter.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use common::process::{ChildGuard, output_within};
use common::{Reply, Upstream, assert_no_overdraw, client, sustained_rate};

async fn scrape(admin: std::net::SocketAddr) -> prometheus_parse::Scrape {
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spec_metric_is_exported_with_its_type_and_labels() {
    let up = Upstream::with(Arc::new(|a| {
        if a.path == "/throttle" {
            Reply::status(429).header("retry-after", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = common::sluice("[defaults]\nrate = 5.0\nburst = 1.0\nmax_wait = \"0s\"\n").await;
    let c = client(s.proxy_addr);
    c.get(up.url("/ok"))
        .header("x-endpoint-id", "m")
        .send()
        .await
        .unwrap();
    c.get(up.url("/ok"))
        .header("x-endpoint-id", "m")
        .send()
        .await
        .unwrap(); // refused
    c.get(up.url("/throttle"))
        .header("x-endpoint-id", "t")
        .send()
        .await
        .unwrap();
    // Gauges are refreshed by the observer once a second.
    common::wait_for("the observer's gauges", Duration::from_secs(5), || async {
        scrape(s.admin_addr)
            .await
            .samples
            .iter()
            .any(|x| x.metric == "sluice_endpoint_rate")
    })
    .await;
    let scrape = scrape(s.admin_addr).await;
    let has = |name: &str, labels: &[&str]| {
        scrape
            .samples
            .iter()
            .any(|x| x.metric == name && labels.iter().all(|l| x.labels.get(l).is_some()))
    };
    assert!(has("sluice_requests_total", &["endpoint", "outcome"]));
    assert!(has("sluice_wait_seconds", &["endpoint"]));
    assert!(has(
        "sluice_upstream_responses_total",
        &["endpoint", "code"]
    ));
    assert!(has("sluice_endpoint_rate", &["endpoint"]));
    assert!(has("sluice_endpoint_at_floor", &["endpoint"]));
    assert!(has("sluice_store_errors_total", &[]));
    assert!(has("sluice_store_seconds", &[]));
    let sample = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|x| x.metric == name)
            .map(|x| x.value.clone())
    };
    // OpenMetrics names a counter family without `_total` in its TYPE line.
    let text = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (family, kind) in [
        ("sluice_requests", "counter"),
        ("sluice_upstream_responses", "counter"),
        ("sluice_store_errors", "counter"),
        ("sluice_wait_seconds", "histogram"),
        ("sluice_store_seconds", "histogram"),
        ("sluice_endpoint_rate", "gauge"),
        ("sluice_endpoint_at_floor", "gauge"),
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} {kind}\n")),
            "{family} is not a {kind}:\n{text}"
        );
    }
    assert!(matches!(
        sample("sluice_endpoint_rate"),
        Some(prometheus_parse::Value::Gauge(_))
    ));
    assert!(matches!(
        sample("sluice_wait_seconds"),
        Some(prometheus_parse::Value::Histogram(_))
    ));
    assert!(matches!(
        sample("sluice_store_seconds"),
        Some(prometheus_parse::Value::Histogram(_))
    ));
    assert!(matches!(
        sample("sluice_endpoint_at_floor"),
        Some(prometheus_parse::Value::Gauge(_))
    ));
    let refused = scrape.samples.iter().any(|x| {
        x.metric == "sluice_requests_total"
            && x.labels.get("endpoint") == Some("m")
            && x.labels.get("outcome") == Some("rate_limited")
    });
    assert!(refused, "refusals are counted by outcome");
    let throttled = scrape.samples.iter().any(|x| {
        x.metric == "sluice_upstream_responses_total"
            && x.labels.get("endpoint") == Some("t")
            && x.labels.get("code") == Some("429")
    });
    assert!(throttled);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_endpoint_ids_cannot_blow_up_metrics() {
    let up = Upstream::start().await;
    let s = common::sluice("[proxy]\nmetrics_max_endpoints = 50\n").await;
    let c = client(s.proxy_addr);
    let mut tasks = Vec::new();
    for w in 0..16 {
        let (c, url) = (c.clone(), up.url("/spray"));
        tasks.push(tokio::spawn(async move {
            for i in (w..10_000).step_by(16) {
                let r = c
                    .get(&url)
                    .header("x-endpoint-id", format!("spray-{i}"))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let sc = scrape(s.admin_addr).await;
    let endpoints: std::collections::HashSet<String> = sc
        .samples
        .iter()
        .filter(|x| x.metric == "sluice_requests_total")
        .filter_map(|x| x.labels.get("endpoint").map(str::to_owned))
        .collect();
    // The cap is used, not just respected: 50 ids by name, the rest folded into `_other`.
    assert_eq!(
        endpoints.len(),
        51,
        "{} endpoint label values",
        endpoints.len()
    );
    assert!(endpoints.contains("_other"));
    // And folding loses no request: the counts add up to what was sent.
    let counted: f64 = sc
        .samples
        .iter()
        .filter(|x| x.metric == "sluice_requests_total")
        .map(|x| match x.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            ref other => panic!("sluice_requests_total is {other:?}"),
        })
        .sum();
    assert_eq!(counted, 10_000.0);
    s.stop().await;
}

/// The sluice binary with a config file, its stderr collected.
struct Proc {
    child: ChildGuard,
    log: Arc<Mutex<String>>,
    /// The stderr reader: done once the process closed its stderr.
    reader: std::thread::JoinHandle<()>,
    admin: std::net::SocketAddr,
}

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

impl Proc {
    fn config(proxy: std::net::SocketAddr, admin: std::net::SocketAddr, rest: &str) -> String {
        format!(
            "[proxy]\nlisten = \"{proxy}\"\nadmin_listen = \"{admin}\"\nshutdown_grace = \"3s\"\n\
             [security]\nallow_private_destinations = true\n{rest}"
        )
    }

    async fn start(path: &Path, admin: std::net::SocketAddr) -> Proc {
        Proc::start_with(path, admin, &[]).await
    }

    /// Like [`start`](Self::start), with extra environment variables for the process.
    async fn start_with_env(
        path: &Path,
        admin: std::net::SocketAddr,
        env: &[(&str, &str)],
    ) -> Proc {
        Proc::launch(path, admin, &[], env).await
    }

    async fn start_with(path: &Path, admin: std::net::SocketAddr, args: &[&str]) -> Proc {
        Proc::launch(path, admin, args, &[]).await
    }

    async fn launch(
        path: &Path,
        admin: std::net::SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let p = Proc::spawn(path, admin, args, env);
        p.wait_log("sluice listening", Duration::from_secs(10))
            .await;
        p
    }

    /// Starts the process without waiting for it to listen.
    fn spawn(
        path: &Path,
        admin: std::net::SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let mut child = ChildGuard::spawn(
            Command::new(env!("CARGO_BIN_EXE_sluice"))
                .args(args)
                .args(["run", "--config"])
                .arg(path)
                .env("RUST_LOG", "debug")
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        );
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.child().stderr.take().unwrap();
        let sink = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proc {
            child,
            log,
            reader,
            admin,
        }
    }

    /// Waits for `needle` in the process's log; on timeout, fails showing the log (a
    /// process that could not start says why there).
    async fn wait_log(&self, needle: &str, limit: Duration) {
        let end = tokio::time::Instant::now() + limit;
        while !self.log.lock().unwrap().contains(needle) {
            assert!(
                tokio::time::Instant::now() < end,
                "timed out after {limit:?} waiting for {needle:?} in the log:\n{}",
                self.log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn signal(&self, sig: &str) {
        let out = output_within(
            Command::new("kill").args([sig, &self.child.id().to_string()]),
            Duration::from_secs(5),
        );
        assert!(out.status.success(), "kill {sig} failed: {out:?}");
    }

    async fn endpoints(&self) -> serde_json::Value {
        reqwest::get(format!("http://{}/endpoints", self.admin))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// SIGTERM, a clean exit within the grace period, and the whole log.
    fn stop(mut self) -> String {
        self.signal("-TERM");
        let status = self.child.wait_within(Duration::from_secs(10));
        assert!(status.success(), "sluice exited with {status}");
        // The process is gone, so its stderr is closed: the reader ends with all of it.
        self.reader.join().expect("log reader");
        self.log.lock().unwrap().clone()
    }
}

fn rate_of(eps: &serde_json::Value, id: &str) -> f64 {
    eps.as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .unwrap()["configured_rate"]
        .as_f64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_limits_under_load_and_refuses_bad_files() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let endpoint = |rate: f64| {
        format!("[[endpoints]]\nid = \"live\"\nrate = {rate}\nburst = 2.0\nmax_wait = \"10s\"\n")
    };
    std::fs::write(&path, Proc::config(proxy, admin, &endpoint(20.0))).unwrap();
    let p = Proc::start(&path, admin).await;
    // Load throughout the reloads.
    let stop_at = Instant::now() + Duration::from_secs(3);
    let c = client(proxy);
    let mut senders = Vec::new();
    for i in 0..4 {
        let (c, url) = (c.clone(), up.url(&format!("/live/{i}")));
        senders.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < stop_at && n < 200 {
                let r = c
                    .get(format!("{url}/{n}"))
                    .header("x-endpoint-id", "live")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                n += 1;
            }
            n
        }));
    }
    // Under load before the reload: the senders are past the burst.
    common::wait_for("load at the old limit", Duration::from_secs(5), || async {
        up.count() >= 6
    })
    .await;
    std::fs::write(&path, Proc::config(proxy, admin, &endpoint(50.0))).unwrap();
    p.signal("-HUP");
    p.wait_log("config reloaded", Duration::from_secs(5)).await;
    let reloaded = Instant::now();
    assert_eq!(rate_of(&p.endpoints().await, "live"), 50.0);
    // A bad file (written, picked up by the file watch) keeps the running limits.
    std::fs::write(
        &path,
        Proc::config(proxy, admin, "[[endpoints]]\nid = \"live\"\nrate = -1.0\n"),
    )
    .unwrap();
    p.wait_log("reload refused", Duration::from_secs(5)).await;
    assert_eq!(rate_of(&p.endpoints().await, "live"), 50.0);
    let mut sent = 0;
    for s in senders {
        sent += s.await.unwrap();
    }
    let arrivals = up.arrivals();
    let unique: std::collections::HashSet<&str> =
        arrivals.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(arrivals.len(), sent, "nothing lost");
    assert_eq!(unique.len(), sent, "nothing doubled");
    // At the upstream: the new limit holds, and is used. Reservations made before the
    // reload (at most one per sender, at the old pace) are over after 0.3 s.
    let after: Vec<Instant> = arrivals
        .iter()
        .map(|a| a.at)
        .filter(|t| *t > reloaded + Duration::from_millis(300))
        .collect();
    assert_no_overdraw(&after, 50.0, 2.0);
    let achieved = sustained_rate(&after, 2);
    assert!(
        achieved >= 0.9 * 50.0,
        "new limit not in use: {achieved:.1}/s"
    );
    let log = p.stop();
    assert!(
        log.contains("endpoints[0].rate"),
        "the refused reload names the key:\n{log}"
    );
}

/// An edit followed by a SIGHUP is one reload, logged once: the file watch must not see
/// the edit again on its next tick and refuse the same file a second time. (The watch
/// may see the edit first when one of its ticks falls between the write and the signal:
/// then the signal reloads again, as a SIGHUP always does. Each refusal says what asked
/// for it, so the test tells the two apart, also when the watch's first tick, at start,
/// comes between them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_and_a_sighup_reload_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    std::fs::write(&path, Proc::config(proxy, admin, "")).unwrap();
    let p = Proc::start(&path, admin).await;
    let bad = "[[endpoints]]\nid = \"live\"\nrate = -1.0\n";
    std::fs::write(&path, Proc::config(proxy, admin, bad)).unwrap();
    p.signal("-HUP");
    p.wait_log("reload refused", Duration::from_secs(5)).await;
    // The watch looks once a second: two and a half of its ticks pass with no second
    // refusal (an observation window, not a wait for a condition).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let log = p.stop();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("reload refused"))
        .collect();
    let by_signal = refusals.iter().filter(|l| l.contains("SIGHUP")).count();
    assert_eq!(by_signal, 1, "the SIGHUP reloads once:\n{log}");
    let after_signal = refusals
        .iter()
        .skip_while(|l| !l.contains("SIGHUP"))
        .skip(1)
        .count();
    assert_eq!(
        after_signal, 0,
        "the watch takes the signalled version as seen:\n{log}"
    );
    assert!(
        refusals
            .iter()
            .all(|l| l.contains("SIGHUP") || l.contains("file changed")),
        "each refusal says what asked for it:\n{log}"
    );
}

/// A SIGHUP while sluice starts (its listeners bound, the store not answering yet) is a
/// reload once it has started, never the end of the process (status 129, no log line),
/// so a hook that reloads on "port open" cannot kill it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_during_start_up_does_not_end_the_process() {
    // A Redis that accepts connections and never answers: start-up waits on it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let redis = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            conns.push(c);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let store =
        format!("[store]\nbackend = \"redis\"\nurls = [\"redis://{redis}/\"]\ntimeout = \"2s\"\n");
    std::fs::write(&path, Proc::config(proxy, admin, &store)).unwrap();
    let p = Proc::spawn(&path, admin, &[], &[]);
    common::wait_for("the proxy port open", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(proxy).await.is_ok()
    })
    .await;
    assert!(
        !p.log.lock().unwrap().contains("sluice listening"),
        "start-up did not wait for the store: the signal would come too late"
    );
    p.signal("-HUP");
    p.wait_log("sluice listening", Duration::from_secs(15))
        .await;
    p.wait_log("config reloaded", Duration::from_secs(5)).await;
    let log = p.stop();
    held.abort();
    assert!(log.contains("sluice listening"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_every_endpoint_and_json_round_trips() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"alpha\"\nrate = 3.0\n[[endpoints]]\nid = \"beta\"\nrate = 4.0\n",
    )
    .await;
    client(s.proxy_addr)
        .get(up.url("/"))
        .header("x-endpoint-id", "gamma")
        .send()
        .await
        .unwrap();
    let admin = format!("http://{}", s.admin_addr);
    let run = move |json: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.args(["status", "--admin", &admin]);
        if json {
            cmd.arg("--json");
        }
        output_within(&mut cmd, Duration::from_secs(10))
    };
    let table = tokio::task::spawn_blocking(move || (run(false), run(true)))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&table.0.stdout).into_owned();
    assert!(table.0.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("ENDPOINT"), "{text}");
    for id in ["alpha", "beta", "gamma"] {
        assert!(
            lines.iter().any(|l| l.starts_with(id)),
            "{id} missing:\n{text}"
        );
    }
    let col = lines[0].find("RATE/S").unwrap();
    assert!(
        lines[1..].iter().all(|l| l.len() > col),
        "columns are aligned:\n{text}"
    );
    let views: Vec<sluice::admin::EndpointView> = serde_json::from_slice(&table.1.stdout).unwrap();
    let again: Vec<sluice::admin::EndpointView> =
        serde_json::from_str(&serde_json::to_string(&views).unwrap()).unwrap();
    assert_eq!(views, again);
    assert_eq!(
        views
            .iter()
            .find(|v| v.id == "beta")
            .unwrap()
            .configured_rate,
        4.0
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_never_show_the_redis_password_or_proxy_credentials() {
    let secret = "hunter2-secret";
    let mut redis = common::redis::RedisServer::start_with_password(secret);
    let port = redis.port();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    // The Redis password is not in the file: it comes from the environment.
    // Proxy authentication on: the user's password must not be logged either.
    let users = dir.path().join("users.htpasswd");
    std::fs::write(
        &users,
        format!("user:{}\n", bcrypt::hash("s3cr3t-pass", 4).unwrap()),
    )
    .unwrap();
    let store = format!(
        "auth_users_file = \"{}\"\n[store]\nbackend = \"redis\"\n\
         urls = [\"redis://:${{SLUICE_REDIS_PASSWORD}}@127.0.0.1:{port}/\"]\n\
         timeout = \"200ms\"\non_error = \"deny\"\n",
        users.display()
    );
    std::fs::write(&path, Proc::config(proxy, admin, &store)).unwrap();
    let p = Proc::start_with_env(&path, admin, &[("SLUICE_REDIS_PASSWORD", secret)]).await;
    let c = client(proxy);
    let r = c
        .get(up.url("/"))
        .header("proxy-authorization", "Basic dXNlcjpzM2NyM3QtcGFzcw==")
        .header("x-endpoint-id", "authed")
        .send()
        .await
        .unwrap();
    // on_error = deny: a 200 means the authenticated Redis decided.
    assert_eq!(r.status(), 200);
    assert_eq!(
        redis.cli(&["EXISTS", "sluice:{authed}"]).as_deref(),
        Some("1")
    );
    let metrics = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!metrics.contains(secret), "password in /metrics");
    // A wrong password is refused (and logged as a refusal, without the credentials).
    let wrong = c
        .get(up.url("/"))
        .header("proxy-authorization", "Basic dXNlcjp3cm9uZy1zM2NyM3Q=")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 407);
    // Nor userinfo in a request target (the decision log's `destination` is built from
    // the checked target), forwarded or refused.
    for auth in [
        "Proxy-Authorization: Basic dXNlcjpzM2NyM3QtcGFzcw==\r\n",
        "",
    ] {
        let target = format!("http://user:url-s3cr3t@{}/ui", up.addr);
        let answer = common::raw_exchange(
            proxy,
            format!(
                "GET {target} HTTP/1.1\r\nHost: x\r\n{auth}X-Endpoint-Id: authed\r\n\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        let want = if auth.is_empty() { "407" } else { "200" };
        assert!(answer.starts_with(&format!("HTTP/1.1 {want}")), "{answer}");
    }
    redis.kill();
    // Errors while Redis is gone get logged; none may carry the password.
    for _ in 0..3 {
        let _ = c
            .get(up.url("/down"))
            .header("proxy-authorization", "Basic dXNlcjpzM2NyM3QtcGFzcw==")
            .send()
            .await
            .unwrap();
    }
    p.wait_log("rate-limit store failed", Duration::from_secs(5))
        .await;
    let log = p.stop();
    assert!(!log.contains(secret), "password in logs:\n{log}");
    assert!(
        !log.contains("dXNlcjpzM2NyM3QtcGFzcw")
            && !log.contains("s3cr3t-pass")
            && !log.contains("wrong-s3cr3t")
            && !log.contains("dXNlcjp3cm9uZy1zM2NyM3Q")
            && !log.contains("url-s3cr3t"),
        "credentials in logs:\n{log}"
    );
    // The two requests with userinfo were logged, with their destination alone.
    let logged = log.matches(&format!("destination=\"{}\"", up.addr)).count();
    assert!(
        logged >= 4,
        "{logged} decision lines name the upstream:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_stuck_at_its_floor_is_logged_once_as_a_warning() {
    let up = Upstream::start().await;
    up.set_responder(Arc::new(|_| Reply::status(429)));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let rest = "[defaults]\nrate = 20.0\nburst = 2.0\nmax_wait = \"5s\"\n\
                [defaults.adaptive]\nenabled = true\nfloor = 4.0\ndecrease = 0.5\n\
                recovery = \"10m\"\ndefault_cooldown = \"100ms\"\nmax_cooldown = \"1s\"\n\
                floor_warn_after = \"1s\"\n";
    std::fs::write(&path, Proc::config(proxy, admin, rest)).unwrap();
    let p = Proc::start(&path, admin).await;
    let c = client(proxy);
    // Endless 429s, one sender, bounded in count and time.
    let needle = "endpoint has stayed at its rate floor";
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut sent = 0;
    while !p.log.lock().unwrap().contains(needle) {
        assert!(
            Instant::now() < deadline && sent < 500,
            "no floor warning after {sent} requests:\n{}",
            p.log.lock().unwrap()
        );
        let r = c
            .get(up.url("/"))
            .header("x-endpoint-id", "stuck")
            .send()
            .await
            .unwrap();
        // The receiver's answer reaches the sender unchanged (or sluice's own cooldown refusal).
        assert!(matches!(r.status().as_u16(), 429 | 503), "{}", r.status());
        sent += 1;
    }
    // Visible on the admin side too: at the floor, rate at the floor.
    let eps = p.endpoints().await;
    let ep = eps
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == "stuck")
        .unwrap()
        .clone();
    assert_eq!(ep["at_floor"], true, "{ep}");
    assert!(ep["rate"].as_f64().unwrap() <= 5.6, "{ep}");
    assert!(ep["at_floor_secs"].as_f64().unwrap() >= 1.0, "{ep}");
    // Keep the endpoint at its floor a little longer: the warning is not repeated.
    for _ in 0..10 {
        let _ = c
            .get(up.url("/"))
            .header("x-endpoint-id", "stuck")
            .send()
            .await
            .unwrap();
    }
    // Let the observer (one look a second) see it at the floor again, twice over.
    let seen = ep["at_floor_secs"].as_f64().unwrap();
    common::wait_for(
        "two more observer periods at the floor",
        Duration::from_secs(5),
        || async {
            let eps = p.endpoints().await;
            eps.as_array().unwrap().iter().any(|e| {
                e["id"] == "stuck"
                    && e["at_floor"] == true
                    && e["at_floor_secs"].as_f64().is_some_and(|s| s >= seen + 2.0)
            })
        },
    )
    .await;
    let log = p.stop();
    assert_eq!(log.matches(needle).count(), 1, "warning repeated:\n{log}");
    assert!(log.contains("WARN"), "not a warning:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_with_a_changed_listener_keeps_serving_on_the_old_one_and_says_so() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin, other) = (free_addr(), free_addr(), free_addr());
    let limits = "[defaults]\nrate = 100.0\nburst = 10.0\n";
    std::fs::write(&path, Proc::config(proxy, admin, limits)).unwrap();
    let p = Proc::start(&path, admin).await;
    std::fs::write(&path, Proc::config(other, admin, limits)).unwrap();
    p.signal("-HUP");
    p.wait_log("needs a restart", Duration::from_secs(5)).await;
    p.wait_log("config reloaded", Duration::from_secs(5)).await;
    let r = client(proxy).get(up.url("/still")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        std::net::TcpStream::connect(other).is_err(),
        "nothing listens on the new address"
    );
    let log = p.stop();
    assert!(
        log.contains("proxy.listen"),
        "the log names the setting:\n{log}"
    );
}

/// The decision log: one JSON line per request with endpoint, user, destination,
/// outcome, waits and upstream status; refusals always, with the endpoint as a field;
/// no ANSI colour codes when stderr is not a terminal.
#[tokio::test]
async fn every_request_leaves_one_decision_line() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let rest = "[[endpoints]]\nid = \"logged\"\nrate = 0.01\nburst = 2.0\nmax_wait = \"0\"\n";
    std::fs::write(&path, Proc::config(proxy, admin, rest)).unwrap();
    let p = Proc::start_with(&path, admin, &["--log-format", "json"]).await;
    let c = client(proxy);
    let mut statuses = Vec::new();
    for i in 0..3 {
        let r = c
            .get(up.url(&format!("/d/{i}")))
            .header("x-endpoint-id", "logged")
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 503]);
    p.wait_log("request refused", Duration::from_secs(5)).await;
    let log = p.stop();
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escape codes in a non-terminal log"
    );
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "sluice::decision")
        .collect();
    assert_eq!(lines.len(), 3, "{log}");
    for (line, want) in lines.iter().zip(["forwarded", "forwarded", "rate_limited"]) {
        assert_eq!(line["endpoint"], "logged", "{line}");
        assert_eq!(line["outcome"], want, "{line}");
        assert_eq!(line["destination"], up.addr.to_string(), "{line}");
        assert!(line["waited_ms"].is_u64(), "{line}");
    }
    assert_eq!(lines[0]["status"], 200);
    assert!(lines[0]["upstream_ms"].is_u64());
}

/// A request whose sender closes its connection while the request is at the receiver
/// (hyper's path) is still counted and leaves one decision line: it reached the
/// receiver. On HTTP/1 a close reads as a half-close, so the line is either "the sender
/// left before the answer" or the answer's own, written to the closed connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_sender_leaves_at_the_receiver_is_logged() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::with(Arc::new(|_: &common::Arrival| {
        Reply::ok().delay(Duration::from_millis(800))
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    std::fs::write(&path, Proc::config(proxy, admin, "")).unwrap();
    let p = Proc::start(&path, admin).await;
    // `Connection: x-hop` is hyper's path (the lane keeps such a request going).
    let mut t = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let head = format!(
        "GET http://{a}/gone HTTP/1.1\r\nHost: {a}\r\nX-Endpoint-Id: left\r\nConnection: x-hop\r\n\r\n",
        a = up.addr
    );
    t.write_all(head.as_bytes()).await.unwrap();
    common::wait_for(
        "the request at the receiver",
        Duration::from_secs(5),
        || std::future::ready(up.count() == 1),
    )
    .await;
    drop(t);
    p.wait_log("endpoint=\"left\"", Duration::from_secs(5))
        .await;
    // And counted: it reached the receiver.
    let text = common::metrics(admin).await;
    assert!(
        text.lines().any(|l| l.starts_with("sluice_requests_total")
            && l.contains("endpoint=\"left\"")
            && l.contains("outcome=\"forwarded\"")
            && l.ends_with(" 1")),
        "{text}"
    );
    let log = p.stop();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sluice::decision") && l.contains("endpoint=\"left\""))
        .collect();
    assert_eq!(lines.len(), 1, "one decision line: {lines:?}");
    assert!(lines[0].contains("outcome=\"forwarded\""), "{}", lines[0]);
}

/// SIGTERM to the real process (sender connections on its worker threads): a request
/// already at the receiver gets its answer, and one waiting for its token is served
/// or refused, within `shutdown_grace`; none is dropped without an answer. A worker pool
/// that stopped as soon as the accept loop did would cancel every connection at once:
/// the receiver's answer would never reach its sender, who would send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_and_waiting_finish() {
    let up = Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path == "/slow" {
            Reply::ok().delay(Duration::from_secs(1))
        } else {
            Reply::ok()
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let rest = "[[endpoints]]\nid = \"ep\"\nrate = 1.0\nburst = 1.0\nmax_wait = \"5s\"\n";
    std::fs::write(&path, Proc::config(proxy, admin, rest)).unwrap();
    let p = Proc::start(&path, admin).await;
    let c = client(proxy);
    let get = |path: &str, ep: &str| {
        let req = c.get(up.url(path)).header("X-Endpoint-Id", ep);
        tokio::spawn(async move {
            let r = req.send().await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.text().await?))
        })
    };
    let in_flight = get("/slow", "other");
    common::wait_for(
        "the slow request to reach the receiver",
        Duration::from_secs(5),
        || async { up.count() >= 1 },
    )
    .await;
    let (status, _) = get("/first", "ep").await.unwrap().unwrap();
    assert_eq!(status, 200);
    let waiting = get("/waits", "ep");
    common::wait_for_tokens_below(admin, "ep", -0.5).await;
    let log = tokio::task::spawn_blocking(move || p.stop()).await.unwrap();
    let (status, body) = in_flight
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the request in flight lost its answer: {e}\n{log}"));
    assert_eq!((status, body.as_str()), (200, "ok"), "{log}");
    let (status, _) = waiting
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the waiting request got no answer: {e}\n{log}"));
    assert!(
        status == 200 || status == 503,
        "waiting request: {status}\n{log}"
    );
}

/// A sender cannot forge lines or fields of the text decision log: an endpoint named
/// through the proxy user (base64, so any byte) with a newline and an ANSI escape, or
/// through the header with quotes and `key=value` text, is written escaped inside the
/// one line of its refusal, never as it came (a second line of the sender's choosing,
/// raw escape bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn senders_cannot_forge_decision_log_lines() {
    use base64::Engine;
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let config = Proc::config(proxy, admin, "")
        .replace("[proxy]\n", "[proxy]\nendpoint_from_proxy_user = true\n");
    std::fs::write(&path, config).unwrap();
    let p = Proc::start(&path, admin).await;
    let forged = "x\nFORGED sluice decision outcome=\"forwarded\" \u{1b}[2J:pw";
    let basic = base64::engine::general_purpose::STANDARD.encode(forged);
    let a = up.addr;
    let first = common::raw_exchange(
        proxy,
        format!(
            "GET http://{a}/p HTTP/1.1\r\nHost: {a}\r\nProxy-Authorization: Basic {basic}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    let second = common::raw_exchange(
        proxy,
        format!("GET http://{a}/h HTTP/1.1\r\nHost: {a}\r\nX-Endpoint-Id: zz\" outcome=forwarded x=\"\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(first.starts_with("HTTP/1.1 400"), "{first}");
    assert!(second.starts_with("HTTP/1.1 400"), "{second}");
    p.wait_log("request refused", Duration::from_secs(5)).await;
    let log = p.stop();
    assert!(
        !log.contains('\u{1b}'),
        "raw escape bytes in the log:\n{log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a line of the sender's own:\n{log}"
    );
    assert!(
        !log.contains("\" outcome=forwarded x=\""),
        "fields of the sender's own:\n{log}"
    );
    assert_eq!(up.count(), 0);
}

/// A Redis that may evict keys to make
/// room (`maxmemory` with `volatile-lru`, ElastiCache's default: every bucket key has a
/// TTL) drops buckets under memory pressure, and an evicted bucket comes back full: a
/// second burst. sluice says so at start; with `noeviction` it says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_named_at_start() {
    let redis = common::redis::RedisServer::start();
    for (policy, warned) in [("volatile-lru", true), ("noeviction", false)] {
        redis.cli(&["CONFIG", "SET", "maxmemory", "100mb"]).unwrap();
        redis
            .cli(&["CONFIG", "SET", "maxmemory-policy", policy])
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (proxy, admin) = (free_addr(), free_addr());
        let path = dir.path().join("sluice.toml");
        let store = format!(
            "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\n",
            redis.url()
        );
        std::fs::write(&path, Proc::config(proxy, admin, &store)).unwrap();
        let p = Proc::start(&path, admin).await;
        // The check runs beside start-up; a readiness answer comes after it here.
        let log = if warned {
            p.wait_log("maxmemory-policy volatile-lru", Duration::from_secs(10))
                .await;
            p.stop()
        } else {
            reqwest::get(format!("http://{admin}/readyz"))
                .await
                .unwrap();
            p.stop()
        };
        assert_eq!(log.contains("lets Redis evict"), warned, "{policy}: {log}");
    }
}

/// An endpoint past `metrics_max_endpoints` that a receiver throttles is still watched:
/// `/endpoints` lists it with its cooldown, and the observer logs its cooldown's end, so
/// a full label cap does not hide new endpoints' cooldowns, floors and stuck-at-floor
/// warnings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_endpoint_past_the_label_cap_is_still_watched() {
    let up = Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path == "/429" {
            Reply::status(429).header("retry-after", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let config = Proc::config(proxy, admin, "").replacen(
        "[proxy]\n",
        "[proxy]\nmetrics_max_endpoints = 2\n",
        1,
    );
    std::fs::write(&path, config).unwrap();
    let p = Proc::start(&path, admin).await;
    let c = client(proxy);
    let send = |id: &'static str, path: &'static str| {
        c.get(up.url(path)).header("x-endpoint-id", id).send()
    };
    for id in ["first", "second"] {
        assert_eq!(send(id, "/").await.unwrap().status(), 200);
    }
    assert_eq!(send("past-cap", "/429").await.unwrap().status(), 429);
    let listed = p.endpoints().await;
    let past = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == "past-cap")
        .unwrap_or_else(|| panic!("past-cap not in /endpoints: {listed}"));
    assert!(past["cooldown_ms"].as_u64().unwrap() > 0, "{past}");
    p.wait_log("cooldown ended", Duration::from_secs(10)).await;
    let log = p.stop();
    assert!(log.contains("past-cap"), "{log}");
}

/// `sluice status` names each endpoint's mode and never shows a negative balance: the
/// requests an enforced endpoint holds until their start are in WAITING, and a
/// shadow endpoint (whose requests go on at once) shows `shadow`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_shadow_mode_and_waiting_requests_not_negative_tokens() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"held\"\nrate = 0.2\nburst = 1.0\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"measured\"\nrate = 0.2\nburst = 1.0\nmode = \"shadow\"\n",
    )
    .await;
    let c = client(s.proxy_addr);
    // Three to the shadow endpoint: all forwarded at once, the bucket 2 below 0.
    for _ in 0..3 {
        let r = c
            .get(up.url("/"))
            .header("x-endpoint-id", "measured")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // Three to the enforced one: the first goes, two wait (for 5 s and 10 s).
    let senders: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (c.clone(), up.url("/"));
            tokio::spawn(async move {
                let _ = c.get(url).header("x-endpoint-id", "held").send().await;
            })
        })
        .collect();
    common::wait_for(
        "two requests waiting for held",
        Duration::from_secs(5),
        || async {
            common::endpoint(s.admin_addr, "held")
                .await
                .is_some_and(|e| e["waiting"] == 2)
        },
    )
    .await;
    let admin = format!("http://{}", s.admin_addr);
    let out = tokio::task::spawn_blocking(move || {
        output_within(
            Command::new(env!("CARGO_BIN_EXE_sluice")).args(["status", "--admin", &admin]),
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let header: Vec<&str> = text
        .lines()
        .next()
        .unwrap()
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let row = |id: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(id))
            .unwrap_or_else(|| panic!("no {id} row:\n{text}"));
        // Cells are two spaces apart; a cell may hold one space ("yes (3s)").
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no {name} column:\n{text}"))
    };
    let (held, measured) = (row("held"), row("measured"));
    assert_eq!(held[col("MODE")], "enforce", "{text}");
    assert_eq!(measured[col("MODE")], "shadow", "{text}");
    assert_eq!(held[col("WAITING")], "2", "{text}");
    for r in [&held, &measured] {
        let tokens: f64 = r[col("TOKENS")].parse().unwrap();
        assert!(tokens >= 0.0, "a negative balance shown:\n{text}");
    }
    for t in senders {
        t.abort();
    }
    s.stop().await;
}

/// Every configured endpoint has its request series from the start, at 0, and one a
/// reload adds has them from that reload: `rate()` and alerts see an endpoint before
/// its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_endpoints_have_request_series_before_their_first_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let (proxy, admin) = (free_addr(), free_addr());
    let endpoints = |ids: &[&str]| -> String {
        ids.iter()
            .map(|id| format!("[[endpoints]]\nid = \"{id}\"\nrate = 5.0\n"))
            .collect()
    };
    std::fs::write(&path, Proc::config(proxy, admin, &endpoints(&["alpha"]))).unwrap();
    let p = Proc::start(&path, admin).await;
    let zero_series = |scrape: &prometheus_parse::Scrape, id: &str| -> Vec<String> {
        scrape
            .samples
            .iter()
            .filter(|s| s.labels.get("endpoint") == Some(id))
            .filter(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => {
                    v == 0.0
                }
                prometheus_parse::Value::Histogram(ref h) => h.iter().all(|b| b.count == 0.0),
                _ => false,
            })
            .map(|s| {
                format!(
                    "{}{{outcome={:?}}}",
                    s.metric,
                    s.labels.get("outcome").unwrap_or("")
                )
            })
            .collect()
    };
    let want = |id: &str, scrape: &prometheus_parse::Scrape| {
        let found = zero_series(scrape, id);
        for series in [
            "sluice_requests_total{outcome=\"forwarded\"}",
            "sluice_requests_total{outcome=\"rate_limited\"}",
            "sluice_requests_total{outcome=\"cooldown\"}",
            "sluice_upstream_throttles_total{outcome=\"\"}",
        ] {
            assert!(
                found.iter().any(|f| f == series),
                "{id}: no {series} at 0 in {found:?}"
            );
        }
    };
    want("alpha", &scrape(admin).await);

    std::fs::write(
        &path,
        Proc::config(proxy, admin, &endpoints(&["alpha", "beta"])),
    )
    .unwrap();
    p.signal("-HUP");
    p.wait_log("config reloaded", Duration::from_secs(5)).await;
    let after = scrape(admin).await;
    want("alpha", &after);
    want("beta", &after);
    p.stop();
}
