//! Where log lines go (`[log] file`, `[log] buffer_lines`): the real binary, with its
//! log on a pipe nobody reads (requests never wait for it; dropped lines are counted in
//! `sluice_log_dropped_total`) and in a file; and the `[log]` keys as the config reads
//! them.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{ChildGuard, RunWithin, output_within};

/// Longest any child process may take before the test fails.
const CHILD_DEADLINE: Duration = Duration::from_secs(30);

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

/// A port free a moment ago (the child binds it next).
fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Waits until something listens on `addr`.
async fn until_listening(addr: SocketAddr, child: &mut ChildGuard) {
    let end = Instant::now() + CHILD_DEADLINE;
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        let exited = child.child().try_wait().unwrap();
        assert!(
            exited.is_none() && Instant::now() < end,
            "sluice never listened on {addr} (exit: {exited:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn signal(child: &ChildGuard, sig: &str) {
    let out = output_within(
        Command::new("kill").args([sig, &child.id().to_string()]),
        Duration::from_secs(5),
    );
    assert!(out.status.success(), "kill {sig} failed: {out:?}");
}

/// The value of an unlabelled sample in the `/metrics` text.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

/// `n` requests through `proxy` to `upstream`, `senders` at a time; every answer 200.
async fn send(proxy: SocketAddr, upstream: &common::Upstream, n: usize, senders: usize) {
    let client = common::client(proxy);
    let tasks: Vec<_> = (0..senders)
        .map(|s| {
            let (client, url) = (client.clone(), upstream.url("/"));
            tokio::spawn(async move {
                for _ in (s..n).step_by(senders) {
                    let r = client
                        .get(&url)
                        .header("X-Endpoint-Id", "logged")
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// With stderr on a pipe nobody reads, the pipe fills after a few hundred lines and the
/// writer thread is stuck in `write(2)`; requests go on at full speed, the lines past
/// the queue are dropped and counted, and SIGTERM still ends the process promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_nobody_reads_never_holds_a_request() {
    let upstream = common::Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (proxy, admin) = (free_port(), free_port());
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\nadmin_listen = \"{admin}\"\n\
             [defaults]\nrate = 1000000.0\nburst = 1000000.0\n\
             [log]\nbuffer_lines = 64\n\
             [security]\nallow_private_destinations = true\n"
        ),
    )
    .unwrap();
    let mut child = ChildGuard::spawn(
        sluice()
            .args(["run", "--config"])
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    // Held open and never read: the pipe's 64 KiB fill and then every write blocks.
    let _unread = child.child().stderr.take().unwrap();
    until_listening(proxy, &mut child).await;
    until_listening(admin, &mut child).await;

    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), send(proxy, &upstream, 2000, 8))
        .await
        .expect("2000 requests within 60 s although nobody reads the log");
    let took = started.elapsed();
    assert_eq!(upstream.count(), 2000);

    let dropped = sample(&common::metrics(admin).await, "sluice_log_dropped_total");
    // Over 2000 lines of ~250 bytes, a 64 KiB pipe and a queue of 64: most are dropped.
    assert!(
        dropped > 1000.0,
        "dropped {dropped} of 2000 lines in {took:?}"
    );

    // The final flush gives up on a writer stuck in the pipe instead of hanging.
    signal(&child, "-TERM");
    let status = child.wait_within(Duration::from_secs(10));
    assert!(status.success(), "sluice exited with {status}");
}

/// `[log] file`: every line, decision lines included, is appended to the file (its
/// path relative to the config's folder), nothing to stderr; the lines logged just
/// before SIGTERM are in the file once the process has exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_land_in_the_file_and_the_last_ones_survive_sigterm() {
    let upstream = common::Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("logs")).unwrap();
    let file = dir.path().join("logs/sluice.log");
    std::fs::write(&file, "an earlier line\n").unwrap();
    let (proxy, admin) = (free_port(), free_port());
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\nadmin_listen = \"{admin}\"\n\
             [log]\nfile = \"logs/sluice.log\"\n\
             [security]\nallow_private_destinations = true\n"
        ),
    )
    .unwrap();
    // Started from elsewhere: the path is the config folder's, not the working
    // directory's.
    let mut child = ChildGuard::spawn(
        sluice()
            .args(["run", "--config"])
            .arg(&path)
            .current_dir(std::env::temp_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let stderr = child.child().stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut { stderr }, &mut text).unwrap();
        text
    });
    until_listening(proxy, &mut child).await;
    send(proxy, &upstream, 5, 1).await;
    signal(&child, "-TERM");
    let status = child.wait_within(CHILD_DEADLINE);
    assert!(status.success(), "sluice exited with {status}");

    let log = std::fs::read_to_string(&file).unwrap();
    assert!(log.starts_with("an earlier line\n"), "appended:\n{log}");
    assert!(log.contains("sluice listening"), "{log}");
    let decisions: Vec<_> = log
        .lines()
        .filter(|l| l.contains("sluice::decision") && l.contains("endpoint=\"logged\""))
        .collect();
    assert_eq!(decisions.len(), 5, "{log}");
    assert!(decisions.iter().all(|l| l.contains("status=200")), "{log}");
    // No colour codes in a file.
    assert!(!log.contains('\u{1b}'), "{log}");
    let err = stderr.join().unwrap();
    assert!(!err.contains("sluice::decision"), "{err}");
}

/// `check` opens `[log] file` as `run` would, and fails naming the key when it cannot.
#[test]
fn check_and_run_name_log_file_when_it_cannot_be_opened() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [log]\nfile = \"no-such-folder/sluice.log\"\n",
    )
    .unwrap();
    let want = format!(
        "log.file: cannot open {}",
        dir.path().join("no-such-folder/sluice.log").display()
    );
    for command in ["check", "run"] {
        let out = sluice()
            .args([command, "--config"])
            .arg(&path)
            .run_within(CHILD_DEADLINE);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {err}");
        assert!(err.contains(&want), "{command}: {err}");
    }
    // An openable file passes (and is created).
    std::fs::create_dir(dir.path().join("no-such-folder")).unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&path)
        .run_within(CHILD_DEADLINE);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.path().join("no-such-folder/sluice.log").exists());
}

fn parse(text: &str) -> Result<sluice::config::Config, String> {
    sluice::config::Config::parse(text).map_err(|issues| {
        issues
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    })
}

#[test]
fn log_keys_default_to_stderr_and_a_bounded_queue() {
    let c = parse("").unwrap();
    assert_eq!(c.log.file, None);
    assert_eq!(c.log.buffer_lines, 128_000);
    assert!(c.log.decisions);
    let c = parse("[log]\nfile = \"\"\n").unwrap();
    assert_eq!(c.log.file, None, "an empty path is unset");
}

#[test]
fn log_file_resolves_against_the_config_folder() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[log]\nfile = \"logs/d.log\"\nbuffer_lines = 1_000\n",
    )
    .unwrap();
    let c = sluice::config::Config::load(&path).unwrap();
    assert_eq!(c.log.file.as_deref(), Some(&*dir.path().join("logs/d.log")));
    assert_eq!(c.log.buffer_lines, 1000);
    std::fs::write(&path, "[log]\nfile = \"/var/log/sluice/d.log\"\n").unwrap();
    let c = sluice::config::Config::load(&path).unwrap();
    assert_eq!(
        c.log.file.as_deref(),
        Some(Path::new("/var/log/sluice/d.log"))
    );
    // A file that does not exist yet is no file issue: run creates it.
    assert!(c.check_files().is_ok());
}

#[test]
fn bad_log_keys_are_named_at_their_line() {
    for (text, want) in [
        ("[log]\nbuffer_lines = 0\n", "log.buffer_lines"),
        ("[log]\nbuffer_lines = 2.5\n", "log.buffer_lines"),
        ("[log]\nbuffer_lines = 99999999999\n", "log.buffer_lines"),
        ("[log]\nfile = 3\n", "log.file"),
        ("[log]\nfiles = \"x.log\"\n", "log.files"),
    ] {
        let err = parse(text).expect_err(text);
        assert!(err.contains("2:"), "{text}: {err}");
        assert!(err.contains(want), "{text}: {err}");
    }
}

/// The log target is set up once, at start: a reload that changes it keeps the running
/// one and names the keys in its restart warning.
#[test]
fn a_reload_keeps_the_running_log_target() {
    let running = parse("[log]\nfile = \"/var/log/sluice/a.log\"\n").unwrap();
    let mut new = parse("[log]\nfile = \"/var/log/sluice/b.log\"\nbuffer_lines = 10\n").unwrap();
    let changed = sluice::app::keep_restart_only(&mut new, &running);
    assert!(changed.contains(&"log.file"), "{changed:?}");
    assert!(changed.contains(&"log.buffer_lines"), "{changed:?}");
    assert_eq!(new.log, running.log);
}

/// A refused request's decision line names the endpoint it asked for when that is what
/// was refused (`unknown_endpoint`), and one refused before naming any says so
/// (`(none resolved)`), never a bare `-`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_resolution_name_the_endpoint_or_say_none_resolved() {
    let upstream = common::Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sluice.log");
    let (proxy, admin) = (free_port(), free_port());
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\nadmin_listen = \"{admin}\"\n\
             [defaults]\nunknown = \"reject\"\n\
             [[endpoints]]\nid = \"known\"\n\
             [log]\nfile = \"sluice.log\"\n\
             [security]\nallow_private_destinations = true\n"
        ),
    )
    .unwrap();
    let mut child = ChildGuard::spawn(
        sluice()
            .args(["run", "--config"])
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    until_listening(proxy, &mut child).await;
    let client = common::client(proxy);
    for (id, status) in [("ghost", 403), ("bad{id}", 400), ("known", 200)] {
        let r = client
            .get(upstream.url("/"))
            .header("X-Endpoint-Id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{id}");
    }
    signal(&child, "-TERM");
    let status = child.wait_within(CHILD_DEADLINE);
    assert!(status.success(), "sluice exited with {status}");
    let log = std::fs::read_to_string(&file).unwrap();
    let decisions: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sluice::decision"))
        .collect();
    assert_eq!(decisions.len(), 3, "{log}");
    let line = |outcome: &str| {
        decisions
            .iter()
            .find(|l| l.contains(&format!("outcome=\"{outcome}\"")))
            .unwrap_or_else(|| panic!("no {outcome} line:\n{log}"))
    };
    assert!(
        line("unknown_endpoint").contains("endpoint=\"ghost\""),
        "{log}"
    );
    assert!(
        line("bad_request").contains("endpoint=\"(none resolved)\""),
        "{log}"
    );
    assert!(line("forwarded").contains("endpoint=\"known\""), "{log}");
    assert!(!log.contains("endpoint=\"-\""), "{log}");
}
