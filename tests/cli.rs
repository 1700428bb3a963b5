//! The `sluice` binary: `check` on good and bad files, `run` on a taken port, `ca init`.

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::{LoggedChild, RunWithin};

/// Longest any child process (curl, the sluice binary) may run before the test fails.
const CHILD_DEADLINE: Duration = Duration::from_secs(30);

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

/// Every `*.toml` under `dir`, recursively, sorted.
fn tomls(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(tomls(&path));
        } else if path.extension().is_some_and(|x| x == "toml") {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn every_shipped_config_passes_check() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let files: Vec<_> = ["config", "deploy"]
        .iter()
        .flat_map(|d| tomls(&root.join(d)))
        .collect();
    for path in &files {
        let out = sluice()
            .args(["check", "--config"])
            .arg(path)
            .run_within(CHILD_DEADLINE);
        assert!(
            out.status.success(),
            "{} fails check: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("ok:"));
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("warning:"),
            "{} warns: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let names: Vec<String> = files
        .iter()
        .map(|p| p.strip_prefix(root).unwrap().display().to_string())
        .collect();
    for want in [
        "config/sluice.example.toml",
        "config/demo.toml",
        "config/recipes/svix.toml",
        "config/recipes/convoy.toml",
        "config/recipes/outpost.toml",
        "config/recipes/hook0.toml",
        "config/recipes/worker-pool.toml",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} not checked: {names:?}"
        );
    }
}

#[test]
fn check_names_every_bad_key_with_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[defaults]\nrate = -3.0\nbrust = 5\n\n[store]\nbackend = \"etcd\"\n",
    )
    .unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("2:8: defaults.rate"), "{err}");
    assert!(err.contains("3:1: defaults.brust"), "{err}");
    assert!(err.contains("6:11: store.backend"), "{err}");
    assert!(err.contains("3 error(s)"), "{err}");
}

#[test]
fn check_on_a_missing_file_exits_1() {
    let out = sluice()
        .args(["check", "--config", "/nonexistent/sluice.toml"])
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/sluice.toml"));
}

#[test]
fn run_exits_2_naming_a_taken_port() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!("[proxy]\nlisten = \"{addr}\"\nadmin_listen = \"127.0.0.1:0\"\n"),
    )
    .unwrap();
    let out = sluice()
        .args(["run", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&addr.to_string()), "{err}");
}

/// A file the config names that `check` refuses (a users file with
/// a hash that is not bcrypt, an empty admin token file) makes `run` exit 1 as `check`
/// does: bad config, not a failure at run time (it exited 2).
#[test]
fn run_exits_1_on_a_named_file_check_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    std::fs::write(&users, "alice:{SHA}W6ph5Mm5Pz8GgiULbPgzG37mj9g=\n").unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "\n").unwrap();
    for extra in [
        format!("[security]\nauth_users_file = \"{}\"\n", users.display()),
        format!("[proxy]\nadmin_token_file = \"{}\"\n", token.display()),
    ] {
        let path = dir.path().join("c.toml");
        let text = format!(
            "{extra}{}",
            if extra.starts_with("[proxy]") {
                "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n".to_owned()
            } else {
                "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n".to_owned()
            }
        );
        std::fs::write(&path, text).unwrap();
        for cmd in ["check", "run"] {
            let out = sluice()
                .args([cmd, "--config"])
                .arg(&path)
                .run_within(CHILD_DEADLINE);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{cmd} with {extra}: {err}");
        }
    }
}

#[test]
fn check_opens_the_store_tls_files() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_pem = rcgen::CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .self_signed(&ca_key)
        .unwrap()
        .pem();
    std::fs::write(&ca, ca_pem).unwrap();
    let not_a_key = dir.path().join("client.key");
    std::fs::write(&not_a_key, "hello").unwrap();
    let check = |store: &str| {
        let path = dir.path().join("sluice.toml");
        std::fs::write(
            &path,
            format!("[store]\nbackend = \"redis\"\nurls = [\"rediss://127.0.0.1:6380/\"]\n{store}"),
        )
        .unwrap();
        sluice()
            .args(["check", "--config"])
            .arg(&path)
            .run_within(CHILD_DEADLINE)
    };
    let ok = check(&format!("tls_ca_file = \"{}\"\n", ca.display()));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let missing = dir.path().join("nope.pem");
    for (store, key, path) in [
        (
            format!("tls_ca_file = \"{}\"\n", missing.display()),
            "store.tls_ca_file",
            &missing,
        ),
        (
            format!(
                "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
                ca.display(),
                not_a_key.display()
            ),
            "store.tls_key_file",
            &not_a_key,
        ),
        (
            format!(
                "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
                not_a_key.display(),
                not_a_key.display()
            ),
            "store.tls_cert_file",
            &not_a_key,
        ),
    ] {
        let out = check(&store);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{store}: {err}");
        assert!(
            err.contains(key) && err.contains(&path.display().to_string()),
            "{store}: {err}"
        );
    }
}

#[test]
fn check_expands_environment_variables_and_never_prints_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        "[store]\nbackend = \"redis\"\nurls = [\"redis://:${SLUICE_TEST_PW}@127.0.0.1:6380/\"]\n",
    )
    .unwrap();
    let run = |pw: Option<&str>| {
        let mut cmd = sluice();
        cmd.args(["check", "--config"]).arg(&path);
        match pw {
            Some(pw) => cmd.env("SLUICE_TEST_PW", pw),
            None => cmd.env_remove("SLUICE_TEST_PW"),
        };
        cmd.run_within(CHILD_DEADLINE)
    };
    let ok = run(Some("hunter2-from-env"));
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(!out.contains("hunter2") && out.contains(":***@"), "{out}");
    let unset = run(None);
    let err = String::from_utf8_lossy(&unset.stderr);
    assert_eq!(unset.status.code(), Some(1));
    assert!(
        err.contains("3:9: store.urls") && err.contains("SLUICE_TEST_PW"),
        "{err}"
    );
}

#[test]
fn version_prints_version_commit_and_build_date() {
    let long = sluice().arg("--version").run_within(CHILD_DEADLINE);
    let sub = sluice().arg("version").run_within(CHILD_DEADLINE);
    assert!(long.status.success() && sub.status.success());
    let text = String::from_utf8_lossy(&long.stdout).trim().to_owned();
    assert_eq!(text, String::from_utf8_lossy(&sub.stdout).trim());
    // sluice 0.1.0 (commit abc1234, built 2025-01-01T00:00:00Z)
    let rest = text
        .strip_prefix(&format!("sluice {} (commit ", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("{text}"));
    let (commit, date) = rest
        .split_once(", built ")
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "{text}"
    );
    let date = date.strip_suffix(')').unwrap_or_else(|| panic!("{text}"));
    assert_eq!(date.len(), "2025-01-01T00:00:00Z".len(), "{text}");
    assert!(date.starts_with("20") && date.ends_with('Z'), "{text}");
}

/// Writes `text` as `dir/name` and runs `sluice check` on it from `cwd`.
fn check_in(cwd: &std::path::Path, config: &std::path::Path) -> std::process::Output {
    sluice()
        .current_dir(cwd)
        .args(["check", "--config"])
        .arg(config)
        .run_within(CHILD_DEADLINE)
}

#[test]
fn check_resolves_relative_paths_against_the_config_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("etc");
    let made = sluice()
        .args(["ca", "init", "--dir"])
        .arg(folder.join("ca"))
        .run_within(CHILD_DEADLINE);
    assert!(made.status.success(), "{made:?}");
    std::fs::write(folder.join("users"), "").unwrap();
    let config = folder.join("sluice.toml");
    std::fs::write(
        &config,
        "[tls]\nintercept = true\nca_cert = \"ca/ca.pem\"\nca_key = \"./ca/ca.key\"\n\
         upstream_roots = [\"ca/ca.pem\"]\n",
    )
    .unwrap();
    // Started from elsewhere: the paths still mean etc/ca/...
    let out = check_in(std::path::Path::new("/"), &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A config given by a relative path works from its own folder too.
    let out = check_in(&folder, std::path::Path::new("sluice.toml"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A grant to a user the users file does not list (a misspelt
/// name) is warned about by `check` (and at start and reload): the real user is left
/// free to spend any endpoint. It stays a warning: the user may be added later.
#[test]
fn check_warns_of_a_grant_to_a_user_not_in_the_users_file() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    let hash = bcrypt::hash("pw", 4).unwrap();
    std::fs::write(&users, format!("alice:{hash}\n")).unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[security]\nauth_users_file = \"{}\"\n[security.user_endpoints]\n\
             alcie = [\"a_*\"]\nalice = [\"a_*\"]\n",
            users.display()
        ),
    )
    .unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("alcie") && err.contains("does not list"),
        "{err}"
    );
    assert!(!err.contains("\"alice\""), "{err}");
}

/// A CA key file its group or others may read (mode & 0o077 != 0) is warned about by
/// `check` and at start, naming the key and the mode: whoever reads it can impersonate
/// any site to the senders. It stays a warning (a secret volume may be readable by a group
/// on purpose).
#[test]
fn a_ca_key_others_can_read_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let made = sluice()
        .args(["ca", "init", "--dir"])
        .arg(dir.path().join("ca"))
        .run_within(CHILD_DEADLINE);
    assert!(made.status.success(), "{made:?}");
    let key = dir.path().join("ca/ca.key");
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [tls]\nintercept = true\nca_cert = \"ca/ca.pem\"\nca_key = \"ca/ca.key\"\n",
    )
    .unwrap();
    let warned = |log: &str| log.contains("tls.ca_key") && log.contains("readable by");
    for mode in [0o600, 0o400, 0o640, 0o604, 0o644] {
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = check_in(dir.path(), &config);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{mode:o}: {err}");
        assert_eq!(warned(&err), mode & 0o077 != 0, "{mode:o}: {err}");
    }
    let mut run = LoggedChild::spawn(sluice().args(["run", "--config"]).arg(&config));
    run.wait_log("sluice listening", CHILD_DEADLINE);
    assert!(warned(&run.log()), "{}", run.log());
}

#[test]
fn check_names_the_key_of_every_missing_or_unreadable_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("a_directory")).unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[proxy]\nadmin_token_file = \"a_directory\"\n\
         [tls]\nintercept = true\nca_cert = \"ca/ca.pem\"\nca_key = \"/nonexistent/ca.key\"\n\
         upstream_roots = [\"roots.pem\"]\n",
    )
    .unwrap();
    let out = check_in(std::path::Path::new("/"), &config);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("4 file(s) cannot be read"), "{err}");
    let folder = dir.path().display().to_string();
    for want in [
        format!("proxy.admin_token_file: cannot read {folder}/a_directory"),
        format!("tls.ca_cert: cannot read {folder}/ca/ca.pem"),
        "tls.ca_key: cannot read /nonexistent/ca.key".to_owned(),
        format!("tls.upstream_roots[0]: cannot read {folder}/roots.pem"),
    ] {
        assert!(err.contains(&want), "no {want:?} in:\n{err}");
    }
    // `run` refuses the same file before binding anything.
    let out = sluice()
        .args(["run", "--config"])
        .arg(&config)
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tls.ca_key"));
}

#[test]
fn check_ignores_the_ca_when_interception_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[tls]\nintercept = false\nca_cert = \"nowhere.pem\"\n",
    )
    .unwrap();
    let out = check_in(dir.path(), &config);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_rejects_a_file_that_is_not_a_ca() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), "not a certificate\n").unwrap();
    std::fs::write(dir.path().join("ca.key"), "not a key\n").unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[tls]\nintercept = true\nca_cert = \"ca.pem\"\nca_key = \"ca.key\"\n",
    )
    .unwrap();
    let out = check_in(dir.path(), &config);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls.ca_cert"), "{err}");
}

/// A sender profile's platform gives up on a request after its own timeout: an endpoint
/// whose `max_wait` plus `upstream_timeout` reaches it is warned about by `check` (exit
/// 0) and in `run`'s start log, naming the endpoint, its line and the figures.
#[test]
fn a_budget_the_sender_times_out_before_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[sender]\nprofile = \"svix\"\n\
         [proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[endpoints]]\nid = \"fits\"\n\
         [[endpoints]]\nid = \"acme\"\nmax_wait = \"40s\"\n",
    )
    .unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let warned = |log: &str| {
        log.contains("10:12: endpoints[1].max_wait: endpoint \"acme\": max_wait 40s + proxy.upstream_timeout 7s = 47s")
            && log.contains("Svix's request timeout of 30s: a duplicate waiting to happen")
    };
    assert!(warned(&err), "{err}");
    assert_eq!(err.matches("warning:").count(), 1, "only acme: {err}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("sender svix"),
        "the summary names the profile"
    );
    let mut run =
        common::process::LoggedChild::spawn(sluice().args(["run", "--config"]).arg(&path));
    run.wait_log("sluice listening", CHILD_DEADLINE);
    assert!(warned(&run.log()), "{}", run.log());
}

/// A profile sluice does not know is refused at its line, as any bad value is.
#[test]
fn check_refuses_an_unknown_sender_profile_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[sender]\nprofile = \"hookdeck\"\n[[endpoints]]\nid = \"e\"\nsender_profile = \"svix\"\n",
    )
    .unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("2:11: sender.profile: \"hookdeck\" is not one of \"svix\", \"convoy\", \"outpost\", \"hook0\""),
        "{err}"
    );
    assert!(err.contains("1 error(s)"), "{err}");
}

/// The proxy and admin addresses a running sluice logged in its "sluice listening" line.
fn listening(run: &mut LoggedChild) -> (std::net::SocketAddr, std::net::SocketAddr) {
    run.wait_log("sluice listening", CHILD_DEADLINE);
    let log = run.log();
    let line = log
        .lines()
        .find(|l| l.contains("sluice listening"))
        .unwrap()
        .to_owned();
    // `key=ADDR` in text logs, `"key":"ADDR"` in JSON ones.
    let addr = |key: &str| -> std::net::SocketAddr {
        let (at, skip) = match line.find(&format!("{key}=")) {
            Some(at) => (at, key.len() + 1),
            None => (line.find(&format!("\"{key}\":\"")).unwrap(), key.len() + 4),
        };
        line[at + skip..]
            .split(|c: char| c.is_whitespace() || c == '"')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (addr("proxy_addr"), addr("admin_addr"))
}

/// One plain request through the proxy at `proxy` (connection closed after it): the
/// status and the header fields, names in lower case.
fn exchange(proxy: std::net::SocketAddr, head: &str) -> (u16, Vec<(String, String)>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(proxy).unwrap();
    s.set_read_timeout(Some(CHILD_DEADLINE)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let head = answer.split("\r\n\r\n").next().unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap();
    let fields = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status.parse().unwrap(), fields)
}

/// A `rate_limited` refusal keeps `Retry-After` in whole seconds (rounded up) and also
/// carries the exact wait in `retry-after-ms` and sluice's budget in `RateLimit`, on
/// both engines: the plain lane and hyper's path (`SLUICE_PLAIN_LANE=0`).
#[test]
fn a_refusal_carries_the_wait_in_milliseconds_on_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    // One token a second: the first request spends it (on a port nobody listens on: a
    // 502, the token stays spent), the second is refused with ~1 s to wait.
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [defaults]\nrate = 0.8\nburst = 1.0\nmax_wait = \"0s\"\n\
         [security]\nallow_private_destinations = true\n",
    )
    .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = closed.local_addr().unwrap();
    drop(closed);
    let request = format!(
        "GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nX-Endpoint-Id: e\r\nConnection: close\r\n\r\n"
    );
    for lane in ["1", "0"] {
        let mut run = LoggedChild::spawn(
            sluice()
                .args(["run", "--config"])
                .arg(&path)
                .env("SLUICE_PLAIN_LANE", lane),
        );
        let (proxy, _) = listening(&mut run);
        let (first, _) = exchange(proxy, &request);
        assert_eq!(first, 502, "lane {lane}: the token is spent");
        let (status, fields) = exchange(proxy, &request);
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("lane {lane}: no {name} in {fields:?}"))
        };
        assert_eq!(status, 503, "lane {lane}");
        assert_eq!(field("x-sluice-reason"), "rate_limited");
        let ms: u64 = field("retry-after-ms").parse().unwrap();
        assert!((1..=1250).contains(&ms), "lane {lane}: {ms}");
        let secs: u64 = field("retry-after").parse().unwrap();
        assert_eq!(
            secs,
            ms.div_ceil(1000),
            "lane {lane}: whole seconds, rounded up"
        );
        assert_eq!(
            field("ratelimit"),
            format!("\"sluice\";r=0;t={secs}"),
            "lane {lane}"
        );
    }
}

/// A proxy listening beyond loopback with neither proxy authentication nor an
/// `allowed_hosts` that names hosts is an open proxy: `check` and `run` refuse it (exit
/// 1, saying how to close it) unless `security.allow_anonymous = true`, and then warn.
/// Loopback (127.0.0.0/8, `::1`), authentication or `allowed_hosts` close it.
#[test]
fn an_open_proxy_is_refused_unless_allowed_and_then_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    let line = common::process::output_with_stdin(
        sluice().args(["passwd", "alice", "--cost", "4"]),
        Some(b"secret\n"),
        CHILD_DEADLINE,
    );
    assert!(line.status.success());
    std::fs::write(&users, &line.stdout).unwrap();
    let write = |name: &str, listen: &str, security: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[proxy]\nlisten = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\n[security]\n{security}\n"
            ),
        )
        .unwrap();
        path
    };
    let check = |path: &std::path::Path| {
        let out = sluice()
            .args(["check", "--config"])
            .arg(path)
            .run_within(CHILD_DEADLINE);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // Refused by both, naming the ways out.
    for (name, security) in [("open.toml", ""), ("star.toml", "allowed_hosts = [\"*\"]")] {
        let open = write(name, "0.0.0.0:0", security);
        let (code, err) = check(&open);
        assert_eq!(code, Some(1), "{name}: {err}");
        for want in [
            "0.0.0.0:0",
            "open proxy",
            "security.allowed_hosts",
            "security.auth_users_file",
            "security.allow_anonymous = true",
        ] {
            assert!(err.contains(want), "{name}: {want:?} in {err}");
        }
        let out = sluice()
            .args(["run", "--config"])
            .arg(&open)
            .run_within(CHILD_DEADLINE);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("security.allow_anonymous = true"), "{err}");
        assert!(!err.contains("sluice listening"), "{err}");
    }

    // Allowed: it runs, and both say so loudly.
    let allowed = write("allowed.toml", "0.0.0.0:0", "allow_anonymous = true");
    let (code, err) = check(&allowed);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("warning: OPEN PROXY"), "{err}");
    let mut run = LoggedChild::spawn(sluice().args(["run", "--config"]).arg(&allowed));
    listening(&mut run);
    assert!(run.log().contains("OPEN PROXY"), "{}", run.log());
    drop(run);

    // Closed: not a word.
    let closed = [
        write(
            "hosts.toml",
            "0.0.0.0:0",
            "allowed_hosts = [\"hooks.example.com\"]",
        ),
        write("auth.toml", "0.0.0.0:0", "auth_users_file = \"users\""),
        write("loopback.toml", "127.0.0.2:0", ""),
        write("v6.toml", "[::1]:0", ""),
        write("mapped.toml", "[::ffff:127.0.0.1]:0", ""),
    ];
    for path in &closed {
        let (code, err) = check(path);
        assert_eq!(code, Some(0), "{}: {err}", path.display());
        assert!(!err.contains("open proxy"), "{}: {err}", path.display());
    }
    let mut run = LoggedChild::spawn(sluice().args(["run", "--config"]).arg(&closed[0]));
    listening(&mut run);
    assert!(!run.log().contains("OPEN PROXY"), "{}", run.log());
}

/// The keys a TOML text shows, set or commented out (`# key = ...` at the start of a
/// line, as the examples show keys without a default): `section.key` (`endpoints.key`
/// for `[[endpoints]]`), plus each section itself. The users under
/// `[security.user_endpoints]` are names, not keys.
fn documented_keys(text: &str) -> std::collections::BTreeSet<String> {
    let mut section = String::new();
    let mut keys = std::collections::BTreeSet::new();
    for line in text.lines() {
        let line = line.strip_prefix('#').map_or(line, str::trim_start);
        if let Some(header) = line.strip_prefix('[') {
            let name = header.trim_start_matches('[');
            if let Some(end) = name.find(']') {
                section = name[..end].to_owned();
                keys.insert(section.clone());
                continue;
            }
        }
        let Some((key, _)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        let is_key = !key.is_empty()
            && key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            && line.starts_with(key);
        if is_key && section != "security.user_endpoints" {
            keys.insert(if section.is_empty() {
                key.to_owned()
            } else {
                format!("{section}.{key}")
            });
        }
    }
    keys
}

/// `config/sluice.example.toml` is the full reference: every key of SPEC.md's config
/// block appears in it (set, or commented out where setting it would change the
/// example), and it names no key SPEC does not. Both parse as TOML, and the example
/// passes `check` (`every_shipped_config_passes_check`).
#[test]
fn the_example_config_shows_every_documented_key() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = std::fs::read_to_string(root.join("docs/SPEC.md")).unwrap();
    let block = spec
        .split("## Config file (TOML)")
        .nth(1)
        .and_then(|s| s.split("```toml\n").nth(1))
        .and_then(|s| s.split("\n```").next())
        .expect("SPEC.md's config block");
    let example = std::fs::read_to_string(root.join("config/sluice.example.toml")).unwrap();
    for (name, text) in [("SPEC.md's block", block), ("the example", &example)] {
        text.parse::<toml::Table>()
            .unwrap_or_else(|e| panic!("{name} is not TOML: {e}"));
    }
    let (documented, shown) = (documented_keys(block), documented_keys(&example));
    assert!(documented.len() > 60, "{documented:?}");
    let missing: Vec<_> = documented.difference(&shown).collect();
    assert!(
        missing.is_empty(),
        "not in config/sluice.example.toml: {missing:?}"
    );
    let unknown: Vec<_> = shown.difference(&documented).collect();
    assert!(
        unknown.is_empty(),
        "not in SPEC.md's config block: {unknown:?}"
    );
    // The defaults it shows are the defaults.
    assert!(example.contains("# prefetch = \"alone\""), "store.prefetch");
}

/// `GET /metrics` of the admin listener at `admin`, as text.
fn metrics_text(admin: std::net::SocketAddr) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(CHILD_DEADLINE)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// A refused reload is counted (`sluice_reload_failures_total`) and logs its error under
/// `error`; an accepted one says what changed: the endpoints added, removed and changed,
/// and the sections.
#[test]
fn reloads_say_what_changed_and_refusals_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let head = "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";
    std::fs::write(
        &path,
        format!("{head}[[endpoints]]\nid = \"a\"\nrate = 1.0\n[[endpoints]]\nid = \"gone\"\n"),
    )
    .unwrap();
    let mut run = LoggedChild::spawn(
        sluice()
            .args(["--log-format", "json", "run", "--config"])
            .arg(&path),
    );
    let (_, admin) = listening(&mut run);
    let failures = |admin| {
        metrics_text(admin)
            .lines()
            .find_map(|l| l.strip_prefix("sluice_reload_failures_total "))
            .map(|n| n.trim().to_owned())
    };
    assert_eq!(failures(admin).as_deref(), Some("0"));

    std::fs::write(&path, format!("{head}[defaults]\nrate = -1.0\n")).unwrap();
    run.wait_log("reload refused", CHILD_DEADLINE);
    let log = run.log();
    let refused = log.lines().find(|l| l.contains("reload refused")).unwrap();
    let line: serde_json::Value = serde_json::from_str(refused).unwrap();
    assert!(
        line["error"]
            .as_str()
            .is_some_and(|e| e.contains("defaults.rate")),
        "{refused}"
    );
    assert!(line.get("i").is_none(), "{refused}");
    assert_eq!(failures(admin).as_deref(), Some("1"));

    std::fs::write(
        &path,
        format!(
            "{head}[defaults]\nrate = 3.0\n[[endpoints]]\nid = \"a\"\nrate = 2.0\n\
             [[endpoints]]\nid = \"new\"\n"
        ),
    )
    .unwrap();
    run.wait_log("config reloaded", CHILD_DEADLINE);
    let log = run.log();
    let reloaded = log.lines().find(|l| l.contains("config reloaded")).unwrap();
    let line: serde_json::Value = serde_json::from_str(reloaded).unwrap();
    assert_eq!(
        line["changed"],
        "endpoints added: new; endpoints removed: gone; endpoints changed: a; changed: defaults",
        "{reloaded}"
    );
    assert_eq!(failures(admin).as_deref(), Some("1"));
}

/// Usage errors exit 1 as SPEC.md says (clap's own code is 2, which sluice keeps for
/// failures at run time); `--help` and `--version` exit 0.
#[test]
fn usage_errors_exit_1_and_help_exits_0() {
    for args in [
        &["frobnicate"][..],
        &["check", "--no-such-flag"],
        &["run", "--config"],
        &["passwd"],
        &["status", "--admin"],
        &["check"],
        &["run"],
    ] {
        let out = sluice()
            .args(args)
            .env_remove("SLUICE_CONFIG")
            .run_within(CHILD_DEADLINE);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("error"), "{args:?}: {err}");
    }
    for args in [&["--help"][..], &["check", "--help"], &["--version"]] {
        let out = sluice().args(args).run_within(CHILD_DEADLINE);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
    }
}

/// The `keytool` command of the README's Java row, as written there.
fn readme_keytool_line() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let row = readme
        .lines()
        .find(|l| l.starts_with("| Java |"))
        .expect("a Java row in the README's client table");
    row.split('`')
        .find(|s| s.starts_with("keytool "))
        .expect("a keytool command in the Java row")
        .to_owned()
}

/// A JDK beside the installed one whose `cacerts` is a copy: its `bin/keytool` and
/// `lib/server/libjvm.so` are copies (the JVM finds its home from libjvm's real path),
/// everything else links to the installed JDK. A command run with this `bin` first
/// on PATH changes only the copy.
fn shadow_jdk(jdk: &std::path::Path, into: &std::path::Path) {
    use std::os::unix::fs::symlink;
    let mirror = |from: &std::path::Path, to: &std::path::Path, keep: &[&str]| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let name = e.unwrap().file_name();
            if !keep.iter().any(|k| name == *k) {
                symlink(from.join(&name), to.join(&name)).unwrap();
            }
        }
    };
    mirror(jdk, into, &["bin", "lib"]);
    mirror(&jdk.join("lib"), &into.join("lib"), &["security", "server"]);
    mirror(
        &jdk.join("lib/security"),
        &into.join("lib/security"),
        &["cacerts"],
    );
    mirror(
        &jdk.join("lib/server"),
        &into.join("lib/server"),
        &["libjvm.so"],
    );
    std::fs::create_dir_all(into.join("bin")).unwrap();
    for (from, to) in [
        ("bin/keytool", "bin/keytool"),
        ("lib/server/libjvm.so", "lib/server/libjvm.so"),
        ("lib/security/cacerts", "lib/security/cacerts"),
    ] {
        std::fs::copy(jdk.join(from), into.join(to)).unwrap();
    }
}

/// The README's Java trust line works verbatim with no `JAVA_HOME` set: it imports
/// the CA into the running JDK's `cacerts` without a prompt. Run against a shadow of
/// the installed JDK, so the machine's store is untouched; skipped without `keytool`.
#[test]
fn the_readme_keytool_line_works_without_java_home() {
    let line = readme_keytool_line();
    assert!(!line.contains('$'), "no environment variable: {line}");
    let Ok(found) = Command::new("sh")
        .args(["-c", "readlink -f \"$(command -v keytool)\""])
        .output()
    else {
        eprintln!("skipped: no sh");
        return;
    };
    let keytool = String::from_utf8_lossy(&found.stdout).trim().to_owned();
    if keytool.is_empty() {
        eprintln!("skipped: keytool is not installed (a JDK or JRE brings it)");
        return;
    }
    let jdk = std::path::Path::new(&keytool)
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap();
    if !jdk.join("lib/server/libjvm.so").exists() || !jdk.join("lib/security/cacerts").exists() {
        eprintln!("skipped: {} is not laid out as a JDK 9+", jdk.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let shadow = dir.path().join("jdk");
    shadow_jdk(jdk, &shadow);
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let out = sluice()
        .args(["ca", "init", "--dir"])
        .arg(work.join("config/ca"))
        .run_within(CHILD_DEADLINE);
    assert!(out.status.success(), "{out:?}");
    let path = format!(
        "{}:{}",
        shadow.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let keytool_in_shadow = |args: &str| {
        Command::new("sh")
            .args(["-c", args])
            .current_dir(&work)
            .env_remove("JAVA_HOME")
            .env("PATH", &path)
            .run_within(Duration::from_secs(60))
    };
    let out = keytool_in_shadow(&line);
    assert!(
        out.status.success(),
        "{line}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = keytool_in_shadow("keytool -list -cacerts -storepass changeit -alias sluice");
    assert!(listed.status.success(), "{listed:?}");
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("trustedCertEntry"),
        "{listed:?}"
    );
}
