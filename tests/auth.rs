//! Proxy authentication and per-sender endpoint grants (issue 11), at a real listener
//! with a real upstream: who may send, and whose budget each sender may spend.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use base64::Engine;
use common::{Upstream, assert_no_overdraw};

use common::process::RunWithin;

/// Longest any child process (curl, the sluice binary) may run before the test fails.
const CHILD_DEADLINE: Duration = Duration::from_secs(30);

/// Cost 4: the minimum bcrypt accepts, so tests stay fast (production files use 10+).
fn htpasswd(dir: &Path, users: &[(&str, &str)]) -> PathBuf {
    let p = dir.join("users.htpasswd");
    let text: String = users
        .iter()
        .map(|(u, pw)| format!("{u}:{}\n", bcrypt::hash(pw, 4).unwrap()))
        .collect();
    std::fs::write(&p, text).unwrap();
    p
}

fn basic(user: &str, password: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    )
}

fn auth_config(users: &Path, extra: &str) -> String {
    format!(
        "[security]\nauth_users_file = \"{}\"\n[security.user_endpoints]\nteam_b = [\"b_*\"]\n{extra}",
        users.display()
    )
}

#[tokio::test]
async fn no_or_wrong_credentials_get_407_and_nothing_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("alice", "wonder")]);
    let up = Upstream::start().await;
    let s = common::sluice(&auth_config(&users, "")).await;
    let c = common::client(s.proxy_addr);
    for auth in [
        None,
        Some(basic("alice", "wrong")),
        Some(basic("mallory", "wonder")),
    ] {
        let mut req = c.get(up.url("/")).header("x-endpoint-id", "victim");
        if let Some(a) = &auth {
            req = req.header("proxy-authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 407, "{auth:?}");
        assert_eq!(r.headers()["proxy-authenticate"], "Basic realm=\"sluice\"");
        assert_eq!(r.headers()["x-sluice-reason"], "proxy_auth_required");
    }
    assert_eq!(up.count(), 0);
    assert_eq!(
        common::tokens(s.admin_addr, "victim").await,
        None,
        "nothing spent"
    );
    let ok = c
        .get(up.url("/"))
        .header("proxy-authorization", basic("alice", "wonder"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let a = up.arrivals();
    assert_eq!(a.len(), 1);
    assert!(!a[0].headers.contains_key("proxy-authorization"));
    let m = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("sluice_requests_total{endpoint=\"_other\",outcome=\"proxy_auth_required\"} 3"),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test]
async fn connect_without_credentials_gets_407() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("alice", "wonder")]);
    let up = Upstream::start().await;
    let s = common::sluice(&auth_config(&users, "")).await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut t = tokio::net::TcpStream::connect(s.proxy_addr).await.unwrap();
    t.write_all(format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", up.addr).as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 2048];
    let n = tokio::time::timeout(Duration::from_secs(10), t.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 407"), "{head}");
    assert!(
        head.contains("proxy-authenticate: basic realm=\"sluice\""),
        "{head}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_granted_user_is_paced_and_a_foreign_endpoint_is_403_with_its_tokens_intact() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("team_b", "pw-b"), ("alice", "wonder")]);
    let up = Upstream::start().await;
    let (rate, burst) = (10.0, 2.0);
    let s = common::sluice(&auth_config(
        &users,
        &format!("[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n"),
    ))
    .await;
    let c = common::client(s.proxy_addr);
    let b = basic("team_b", "pw-b");
    // The victim endpoint has spent nothing yet; team_b may not touch it.
    for _ in 0..5 {
        let r = c
            .get(up.url("/x"))
            .header("proxy-authorization", &b)
            .header("x-endpoint-id", "victim")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert_eq!(r.headers()["x-sluice-reason"], "endpoint_not_allowed");
    }
    assert_eq!(up.count(), 0);
    assert_eq!(
        common::tokens(s.admin_addr, "victim").await,
        None,
        "victim's bucket untouched"
    );
    // Paced as before on its own endpoint: 20 requests at 10/s, burst 2.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (c, b, url) = (c.clone(), b.clone(), up.url(&format!("/b/{i}")));
        tasks.push(tokio::spawn(async move {
            c.get(url)
                .header("proxy-authorization", b)
                .header("x-endpoint-id", "b_hooks")
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let times: Vec<Instant> = up.arrivals().iter().map(|a| a.at).collect();
    assert_eq!(times.len(), 20);
    assert_no_overdraw(&times, rate, burst);
    // A user without grants may spend any endpoint.
    let r = c
        .get(up.url("/alice"))
        .header("proxy-authorization", basic("alice", "wonder"))
        .header("x-endpoint-id", "victim")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    s.stop().await;
}

#[tokio::test]
async fn user_plus_endpoint_in_the_proxy_url_names_the_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("team_b", "pw-b")]);
    let up = Upstream::start().await;
    let s = common::sluice(&auth_config(
        &users,
        "[proxy]\nendpoint_from_proxy_user = true\n[defaults]\nrate = 0.001\nburst = 1.0\nmax_wait = \"0\"\n",
    ))
    .await;
    // reqwest takes the credentials from the proxy URL, as HTTP_PROXY users write them.
    let c = reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!("http://team_b+b_42:pw-b@{}", s.proxy_addr)).unwrap())
        .build()
        .unwrap();
    assert_eq!(c.get(up.url("/1")).send().await.unwrap().status(), 200);
    let second = c.get(up.url("/2")).send().await.unwrap();
    assert_eq!(second.status(), 503, "the b_42 bucket (burst 1) is spent");
    assert!(common::tokens(s.admin_addr, "b_42").await.is_some());
    let foreign = reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!("http://team_b+a_1:pw-b@{}", s.proxy_addr)).unwrap())
        .build()
        .unwrap();
    let r = foreign.get(up.url("/3")).send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["x-sluice-reason"], "endpoint_not_allowed");
    assert_eq!(up.count(), 1);
    s.stop().await;
}

#[tokio::test]
async fn a_user_removed_and_reloaded_is_refused_from_the_next_request() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("alice", "wonder"), ("bob", "builder")]);
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[security]\nallow_private_destinations = true\nauth_users_file = \"{}\"\n",
            users.display()
        ),
    )
    .unwrap();
    let up = Upstream::start().await;
    let s = sluice::app::start(sluice::config::Config::load(&path).unwrap())
        .await
        .unwrap();
    let c = common::client(s.proxy_addr);
    let bob = basic("bob", "builder");
    let send = |auth: String| {
        let c = c.clone();
        let url = up.url("/");
        async move {
            c.get(url)
                .header("proxy-authorization", auth)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(send(bob.clone()).await, 200);
    assert_eq!(send(bob.clone()).await, 200, "cached");
    htpasswd(dir.path(), &[("alice", "wonder")]);
    sluice::app::reload(&s.app, &path).unwrap();
    assert_eq!(send(bob).await, 407, "bob was removed");
    assert_eq!(send(basic("alice", "wonder")).await, 200);
    s.stop().await;
}

/// A reload never switches a safeguard off by leaving its key out:
/// a config file cut short while it is written (or emptied) used to open the proxy to
/// every sender, `/metrics` to anyone, and every endpoint and host to every user. The
/// running values stay, and the restart-only warning names them; a reload may still
/// change them to other values. `shutdown_grace` is kept the same way (a reload said
/// nothing, and SIGTERM used the old value).
#[tokio::test]
async fn a_reload_never_switches_a_safeguard_off() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(dir.path(), &[("alice", "wonder")]);
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "t0ken\n").unwrap();
    let path = dir.path().join("sluice.toml");
    let head = "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";
    let full = format!(
        "{head}shutdown_grace = \"1s\"\nadmin_token_file = \"{}\"\n\
         [defaults]\nunknown = \"reject\"\n[[endpoints]]\nid = \"a_1\"\n[[endpoints]]\nid = \"b_1\"\n\
         [security]\nallow_private_destinations = true\nallowed_hosts = [\"127.0.0.1\"]\n\
         auth_users_file = \"{}\"\n[security.user_endpoints]\nalice = [\"a_*\"]\n",
        token.display(),
        users.display()
    );
    std::fs::write(&path, &full).unwrap();
    let running = sluice::config::Config::load(&path).unwrap();
    let up = Upstream::start().await;
    let s = sluice::app::start(running.clone()).await.unwrap();
    let c = common::client(s.proxy_addr);
    let alice = basic("alice", "wonder");
    let send = |auth: Option<&str>, id: &str, url: String| {
        let mut r = c.get(url).header("x-endpoint-id", id);
        if let Some(a) = auth {
            r = r.header("proxy-authorization", a);
        }
        async move {
            let r = r.send().await.unwrap();
            r.status()
        }
    };
    let metrics = || async {
        reqwest::get(format!("http://{}/metrics", s.admin_addr))
            .await
            .unwrap()
            .status()
    };
    let localhost = format!("http://localhost:{}/", up.addr.port());
    let check = || async {
        assert_eq!(send(None, "a_1", up.url("/")).await, 407, "authentication");
        assert_eq!(
            send(Some(&alice), "b_1", up.url("/")).await,
            403,
            "alice's grant"
        );
        assert_eq!(
            send(Some(&alice), "a_zz", up.url("/")).await,
            403,
            "unknown = reject"
        );
        assert_eq!(
            send(Some(&alice), "a_1", localhost.clone()).await,
            403,
            "allowed_hosts"
        );
        assert_eq!(metrics().await, 401, "the admin token");
    };
    check().await;
    assert_eq!(send(Some(&alice), "a_1", up.url("/")).await, 200);
    // The file cut short before its [defaults] table, as a writer may leave it.
    let cut = format!("{head}shutdown_grace = \"20s\"\n");
    std::fs::write(&path, &cut).unwrap();
    let mut new = sluice::config::Config::load(&path).unwrap();
    let named = sluice::app::keep_restart_only(&mut new, &running);
    assert_eq!(
        named,
        [
            "proxy.shutdown_grace",
            "security.auth_users_file (turning proxy authentication off)",
            "security.allowed_hosts (emptying it allows every host)",
            "security.user_endpoints (a user's grants left out; lift them with [\"*\"])",
            "proxy.admin_token_file (opening /metrics and /endpoints)",
            "defaults.unknown (from \"reject\")",
        ]
    );
    sluice::app::reload(&s.app, &path).unwrap();
    check().await;
    // The endpoints went with the cut file, and `unknown = "reject"` stayed: closed.
    assert_eq!(send(Some(&alice), "a_1", up.url("/")).await, 403);
    assert_eq!(up.count(), 1, "only alice's one granted request arrived");
    // Changing them to other values is a reload like any other: another users file,
    // alice's grants lifted with ["*"].
    let other = dir.path().join("other.htpasswd");
    std::fs::copy(&users, &other).unwrap();
    let changed = full
        .replace("users.htpasswd", "other.htpasswd")
        .replace("alice = [\"a_*\"]", "alice = [\"*\"]");
    std::fs::write(&path, changed).unwrap();
    sluice::app::reload(&s.app, &path).unwrap();
    let rt = s.app.runtime.load_full();
    assert_eq!(
        rt.config.security.auth_users_file.as_deref(),
        Some(other.as_path())
    );
    assert_eq!(
        send(Some(&alice), "b_1", up.url("/")).await,
        200,
        "grants lifted"
    );
    s.stop().await;
}

#[tokio::test]
async fn admin_token_guards_metrics_and_endpoints_but_not_probes() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "t0ken-123\n").unwrap();
    let s = common::sluice(&format!(
        "[proxy]\nadmin_token_file = \"{}\"\n",
        token.display()
    ))
    .await;
    let c = reqwest::Client::new();
    let base = format!("http://{}", s.admin_addr);
    for path in ["/metrics", "/endpoints"] {
        let r = c.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = c
            .get(format!("{base}{path}"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = c
            .get(format!("{base}{path}"))
            .bearer_auth("t0ken-123")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        // The scheme in any case (RFC 9110 §11.1); another scheme, or the token alone,
        // is no token.
        for (value, status) in [
            ("bearer t0ken-123", 200),
            ("BEARER t0ken-123", 200),
            ("Basic t0ken-123", 401),
            ("t0ken-123", 401),
        ] {
            let r = c
                .get(format!("{base}{path}"))
                .header("authorization", value)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), status, "{path} {value}");
        }
    }
    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            c.get(format!("{base}{path}"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
    // A 405 names the methods allowed (RFC 9110 §15.5.6).
    let r = c.post(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "GET, HEAD");
    s.stop().await;
}

#[test]
fn check_names_bad_lines_of_the_users_file() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    std::fs::write(&users, "ok:$2y$04$abcdefghijklmnopqrstuuBHuVSm3M1l0K3W2oZ8d7bPl0WJbE7S.\nbroken line\ncarol:{SHA}abc=\n").unwrap();
    let cfg = dir.path().join("sluice.toml");
    std::fs::write(
        &cfg,
        format!("[security]\nauth_users_file = \"{}\"\n", users.display()),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config"])
        .arg(&cfg)
        .run_within(CHILD_DEADLINE);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains("line 3") && err.contains("bcrypt"), "{err}");
}

/// Credentials on the CONNECT authenticate the whole intercepted tunnel; each request
/// inside is paced on its own, and a user removed by a reload is refused inside the
/// tunnel from its next request.
#[tokio::test]
async fn intercepted_https_with_credentials_on_the_connect_paces_each_request() {
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let ca = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let pki = TestPki::new(&["localhost"]);
    let upstream_ca = pki.write_ca(dir.path());
    let up = TlsUpstream::ok(&pki).await;
    let users = htpasswd(dir.path(), &[("team_b", "pw-b"), ("alice", "wonder")]);
    let (rate, burst) = (10.0, 2.0);
    let path = dir.path().join("sluice.toml");
    let write = |users_file: &Path| {
        std::fs::write(
            &path,
            format!(
                "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
                 [defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n\
                 [tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n\
                 [security]\nallow_private_destinations = true\nauth_users_file = \"{}\"\n\
                 [security.user_endpoints]\nteam_b = [\"b_*\"]\n",
                ca.cert.display(),
                ca.key.display(),
                upstream_ca.display(),
                users_file.display()
            ),
        )
        .unwrap()
    };
    write(&users);
    let s = sluice::app::start(sluice::config::Config::load(&path).unwrap())
        .await
        .unwrap();
    let client = |user: &str, pw: &str| {
        let pem = std::fs::read(&ca.cert).unwrap();
        reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .proxy(
                reqwest::Proxy::https(format!("http://{}", s.proxy_addr))
                    .unwrap()
                    .basic_auth(user, pw),
            )
            .http1_only()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap()
    };
    let b = client("team_b", "pw-b");
    for i in 0..20 {
        let r = b
            .get(up.url(&format!("/in/{i}")))
            .header("x-endpoint-id", "b_tls")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let times: Vec<Instant> = up.arrivals().iter().map(|a| a.at).collect();
    assert_eq!(times.len(), 20);
    assert_no_overdraw(&times, rate, burst);
    // Inside the tunnel, grants still hold.
    let r = b
        .get(up.url("/foreign"))
        .header("x-endpoint-id", "victim")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["x-sluice-reason"], "endpoint_not_allowed");
    // Wrong credentials on the CONNECT: no tunnel at all.
    let wrong = client("team_b", "nope").get(up.url("/x")).send().await;
    assert!(wrong.is_err(), "a tunnel opened with a wrong password");
    // alice's password changed: her open tunnel refuses the next request, and team_b's,
    // whose line is unchanged, goes on.
    let a = client("alice", "wonder");
    let get = |c: &reqwest::Client, path: &str, endpoint: &str| {
        c.get(up.url(path)).header("x-endpoint-id", endpoint).send()
    };
    assert_eq!(get(&a, "/alice", "a_tls").await.unwrap().status(), 200);
    let text = std::fs::read_to_string(&users).unwrap();
    let team_b = text.lines().find(|l| l.starts_with("team_b:")).unwrap();
    let rotated = dir.path().join("rotated.htpasswd");
    let alice = bcrypt::hash("new-pw", 4).unwrap();
    std::fs::write(&rotated, format!("{team_b}\nalice:{alice}\n")).unwrap();
    write(&rotated);
    sluice::app::reload(&s.app, &path).unwrap();
    let r = get(&a, "/alice-after", "a_tls").await.unwrap();
    assert_eq!(r.status(), 407, "a tunnel outlived its password");
    assert_eq!(get(&b, "/b-after", "b_tls").await.unwrap().status(), 200);
    let new = client("alice", "new-pw");
    assert_eq!(
        get(&new, "/alice-new", "a_tls").await.unwrap().status(),
        200
    );
    // team_b removed: its open tunnel refuses the next request.
    write(&htpasswd(dir.path(), &[("alice", "wonder")]));
    sluice::app::reload(&s.app, &path).unwrap();
    let r = b
        .get(up.url("/after"))
        .header("x-endpoint-id", "b_tls")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 407);
    assert_eq!(up.arrivals().len(), 23);
    s.stop().await;
}

/// bcrypt checks a password's first 72 bytes only: `passwd` refuses
/// a longer one (it accepted it, and then any password sharing its first 72 bytes
/// logged in). 72 bytes is still accepted.
#[test]
fn passwd_refuses_a_password_bcrypt_would_cut() {
    let run = |password: &str| {
        common::process::output_with_stdin(
            std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
                .args(["passwd", "dave", "--cost", "4"]),
            Some(format!("{password}\n").as_bytes()),
            CHILD_DEADLINE,
        )
    };
    let long = run(&format!("{}REAL", "x".repeat(72)));
    assert_eq!(long.status.code(), Some(1));
    assert!(long.stdout.is_empty());
    let said = String::from_utf8_lossy(&long.stderr);
    assert!(said.contains("at most 72 bytes"), "{said}");
    let whole = run(&"x".repeat(72));
    assert!(whole.status.success());
}

/// `sluice status` reaches an admin listener that wants a token
/// (`--admin-token-file`), and says what is missing when it has none; before, it had no
/// way to send one and failed with a bare 401.
#[tokio::test]
async fn status_sends_the_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "t0ken-123\n").unwrap();
    let s = common::sluice(&format!(
        "[proxy]\nadmin_token_file = \"{}\"\n[[endpoints]]\nid = \"alpha\"\n",
        token.display()
    ))
    .await;
    let admin = format!("http://{}", s.admin_addr);
    let run = move |token: Option<std::path::PathBuf>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.args(["status", "--admin", &admin]);
        cmd.env_remove("SLUICE_ADMIN_TOKEN_FILE");
        if let Some(t) = token {
            cmd.arg("--admin-token-file").arg(t);
        }
        common::process::output_within(&mut cmd, CHILD_DEADLINE)
    };
    let (without, with) = tokio::task::spawn_blocking(move || (run(None), run(Some(token))))
        .await
        .unwrap();
    assert!(!without.status.success());
    let said = String::from_utf8_lossy(&without.stderr);
    assert!(said.contains("--admin-token-file"), "{said}");
    let table = String::from_utf8_lossy(&with.stdout);
    assert!(with.status.success(), "{table}");
    assert!(table.lines().any(|l| l.starts_with("alpha")), "{table}");
    s.stop().await;
}

#[test]
fn passwd_prints_a_line_the_users_file_accepts() {
    let out = common::process::output_with_stdin(
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["passwd", "carol", "--cost", "4"]),
        Some(b"c4rol-pw\n"),
        CHILD_DEADLINE,
    );
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let (user, hash) = line.trim().split_once(':').unwrap();
    assert_eq!(user, "carol");
    assert!(bcrypt::verify("c4rol-pw", hash).unwrap());
    assert!(sluice::auth::Users::parse(&line, &[]).is_ok());
}

/// Sends one request through an open tunnel and reads its answer: `None` once the
/// tunnel is closed (EOF or reset) instead.
async fn through_tunnel(t: &mut tokio::net::TcpStream, host: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
    t.write_all(req.as_bytes()).await.ok()?;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = t.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return Some(text);
            }
        }
    }
}

/// Opens a CONNECT tunnel (no interception) to `up` as `auth` on endpoint `endpoint`.
async fn open_tunnel(
    proxy: std::net::SocketAddr,
    up: std::net::SocketAddr,
    auth: &str,
    endpoint: &str,
) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut t = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let connect = format!(
        "CONNECT {up} HTTP/1.1\r\nHost: {up}\r\nProxy-Authorization: {auth}\r\nX-Endpoint-Id: {endpoint}\r\n\r\n"
    );
    t.write_all(connect.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            t.read(&mut byte).await.unwrap(),
            1,
            "CONNECT answer cut short"
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    t
}

/// The reload tests' users file (alice, bob, carol, team_b) and config file, team_b
/// granted `grants`: the temporary folder, the users file and the config's path.
fn four_users(grants: &str) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(
        dir.path(),
        &[
            ("alice", "wonder"),
            ("bob", "builder"),
            ("carol", "singer"),
            ("team_b", "pw-b"),
        ],
    );
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, grants_config(&users, grants)).unwrap();
    (dir, users, path)
}

fn grants_config(users: &std::path::Path, grants: &str) -> String {
    format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[security]\nallow_private_destinations = true\nauth_users_file = \"{}\"\n[security.user_endpoints]\nteam_b = [{grants}]\n",
        users.display()
    )
}

/// Reloads with bob removed, carol's password changed and team_b no longer granted
/// `b_*`: alice alone keeps her right to send. Every other line stays as it was (a new
/// hash for the same password is a change).
fn revoke(users: &std::path::Path, path: &std::path::Path, s: &sluice::app::Running) {
    let lines: String = std::fs::read_to_string(users)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("bob:"))
        .map(|l| match l.starts_with("carol:") {
            true => format!("carol:{}\n", bcrypt::hash("another", 4).unwrap()),
            false => format!("{l}\n"),
        })
        .collect();
    std::fs::write(users, lines).unwrap();
    std::fs::write(path, grants_config(users, "\"c_*\"")).unwrap();
    sluice::app::reload(&s.app, path).unwrap();
}

/// A TCP server that echoes what it is sent, on 127.0.0.1.
async fn echo_server() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = c.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Sends `line` through the tunnel and reads as many bytes back; `None` when the tunnel
/// closed.
async fn echoed(t: &mut tokio::net::TcpStream, line: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    t.write_all(line.as_bytes()).await.ok()?;
    let mut got = vec![0u8; line.len()];
    t.read_exact(&mut got).await.ok()?;
    Some(String::from_utf8_lossy(&got).into_owned())
}

/// A tunnel relayed as bytes (neither TLS nor HTTP inside, no interception) is closed
/// by a reload that removes its user, changes the password it was opened with or takes
/// its endpoint out of the user's grants: a revoked sender keeps no busy tunnel. Only
/// those tunnels close.
#[tokio::test]
async fn a_reload_closes_the_byte_tunnels_of_senders_it_revokes() {
    let (_dir, users, path) = four_users("\"b_*\"");
    let echo = echo_server().await;
    let s = sluice::app::start(sluice::config::Config::load(&path).unwrap())
        .await
        .unwrap();
    let mut tunnels = Vec::new();
    for (user, pw, ep) in [
        ("alice", "wonder", "a_1"),
        ("bob", "builder", "b_1"),
        ("carol", "singer", "c_1"),
        ("team_b", "pw-b", "b_2"),
    ] {
        let mut t = open_tunnel(s.proxy_addr, echo, &basic(user, pw), ep).await;
        let first = echoed(&mut t, "SSH-2.0-before\r\n").await;
        assert_eq!(first.as_deref(), Some("SSH-2.0-before\r\n"), "{user}");
        tunnels.push((user, t));
    }
    revoke(&users, &path, &s);
    let deadline = Duration::from_secs(5);
    for (user, t) in tunnels.iter_mut() {
        let after = tokio::time::timeout(deadline, echoed(t, "SSH-2.0-after\r\n")).await;
        match *user {
            "alice" => assert!(
                after.is_ok_and(|r| r.is_some_and(|r| r == "SSH-2.0-after\r\n")),
                "alice's tunnel still serves her"
            ),
            _ => assert!(
                matches!(after, Ok(None)),
                "{user}'s tunnel must be closed by the reload, not left open"
            ),
        }
    }
    drop(tunnels);
    s.stop().await;
}

/// Plain HTTP inside a tunnel is served request by request: after a reload, the
/// requests of a sender it no longer admits are refused one by one (407 for a removed
/// user or a changed password, 403 for a withdrawn grant) and none reaches the
/// receiver; the admitted sender's still do.
#[tokio::test]
async fn a_reload_refuses_revoked_senders_requests_inside_tunnels() {
    let (_dir, users, path) = four_users("\"b_*\"");
    let up = Upstream::start().await;
    let s = sluice::app::start(sluice::config::Config::load(&path).unwrap())
        .await
        .unwrap();
    let host = up.addr.to_string();
    let mut tunnels = Vec::new();
    for (user, pw, ep) in [
        ("alice", "wonder", "a_1"),
        ("bob", "builder", "b_1"),
        ("carol", "singer", "c_1"),
        ("team_b", "pw-b", "b_2"),
    ] {
        let mut t = open_tunnel(s.proxy_addr, up.addr, &basic(user, pw), ep).await;
        let first = through_tunnel(&mut t, &host, "/before").await;
        assert!(
            first.is_some_and(|r| r.starts_with("HTTP/1.1 200")),
            "{user}"
        );
        tunnels.push((user, t));
    }
    revoke(&users, &path, &s);
    let arrived = up.count();
    let deadline = Duration::from_secs(5);
    for (user, t) in tunnels.iter_mut() {
        let after = tokio::time::timeout(deadline, through_tunnel(t, &host, "/after")).await;
        match *user {
            "alice" => assert!(
                after.is_ok_and(|r| r.is_some_and(|r| r.starts_with("HTTP/1.1 200"))),
                "alice's tunnel still serves her"
            ),
            "team_b" => assert!(
                after.is_ok_and(|r| r.is_some_and(|r| r.starts_with("HTTP/1.1 403"))),
                "team_b's grant is withdrawn"
            ),
            _ => assert!(
                after.is_ok_and(|r| r.is_some_and(|r| r.starts_with("HTTP/1.1 407"))),
                "{user} is no longer admitted"
            ),
        }
    }
    assert_eq!(
        up.count(),
        arrived + 1,
        "only alice's request arrived after the reload"
    );
    drop(tunnels);
    s.stop().await;
}
