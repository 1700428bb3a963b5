//! File descriptors: a `proxy.max_connections` the process's `RLIMIT_NOFILE` cannot
//! hold is warned about at start and capped, so the admin listener keeps descriptors
//! for its probes however many senders connect.

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::LoggedChild;

/// Longest the child may take to start.
const START: Duration = Duration::from_secs(30);

/// Under `prlimit --nofile=256` (soft and hard, so the limit cannot be raised), sluice with
/// the default `max_connections = 10000` warns at start naming both figures and serves
/// fewer senders at once, so with 300 idle sender connections open `/healthz` still
/// answers.
#[tokio::test]
async fn a_descriptor_limit_too_low_is_warned_about_and_healthz_answers() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmax_connections = 10000\n",
    )
    .unwrap();
    let mut run = LoggedChild::spawn(
        Command::new("prlimit")
            .arg("--nofile=256:256")
            .arg(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--config"])
            .arg(&config),
    );
    run.wait_log("sluice listening", START);
    let log = run.log();
    let addr = |key: &str| -> std::net::SocketAddr {
        let line = log
            .lines()
            .find(|l| l.contains("sluice listening"))
            .unwrap();
        let at = line.find(&format!("{key}=")).unwrap() + key.len() + 1;
        line[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (proxy, admin) = (addr("proxy_addr"), addr("admin_addr"));
    assert!(
        log.contains("RLIMIT_NOFILE") && log.contains("256") && log.contains("10000"),
        "{log}"
    );
    let mut senders = Vec::new();
    for _ in 0..300 {
        senders.push(tokio::net::TcpStream::connect(proxy).await.unwrap());
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let health = client.get(format!("http://{admin}/healthz")).send().await;
    assert!(
        health.as_ref().is_ok_and(|r| r.status() == 200),
        "{health:?}\n{}",
        run.log()
    );
    drop(senders);
}
