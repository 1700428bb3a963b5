//! The README's 60-second walkthrough, run from the README itself.
//!
//! The test starts `sluice demo-receiver` and `sluice run --config config/demo.toml`
//! (the two commands the walkthrough opens with, on free ports instead of 9000 / 8080 /
//! 9090), then runs each later `sh` block of the section with bash, verbatim except for
//! those ports and `cargo run --release --` → this build's binary. What it asserts is
//! measured at the receiver: pacing, nothing sent for a 503, nothing during a cooldown.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::process::{ChildGuard, output_within};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A child process that dies with the test (its guard kills it on drop), and the lines
/// it has printed so far.
struct Proc {
    _child: ChildGuard,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Spawns `cmd` and collects the lines of its stdout or stderr.
    fn spawn(mut cmd: Command, from_stderr: bool) -> Proc {
        cmd.stdin(Stdio::null());
        if from_stderr {
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        }
        let mut child = ChildGuard::spawn(&mut cmd);
        let out: Box<dyn Read + Send> = if from_stderr {
            Box::new(child.child().stderr.take().unwrap())
        } else {
            Box::new(child.child().stdout.take().unwrap())
        };
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        Proc {
            _child: child,
            lines,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits until `f` finds something in the lines printed so far.
    fn wait_for<T>(&self, what: &str, mut f: impl FnMut(&[String]) -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(v) = f(&self.lines()) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; output so far:\n{}",
                self.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One request as the demo receiver printed it.
#[derive(Debug, Clone)]
struct Arrival {
    /// Seconds since the receiver started.
    t: f64,
    target: String,
    status: u16,
}

/// Parses `HH:MM:SS.mmmZ #N t=1.234s +0.201s GET /path -> 200 ...`.
fn arrivals(lines: &[String]) -> Vec<Arrival> {
    lines
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 8 || !f[1].starts_with('#') || f[6] != "->" {
                return None;
            }
            Some(Arrival {
                t: f[2].strip_prefix("t=")?.strip_suffix('s')?.parse().ok()?,
                target: f[5].to_owned(),
                status: f[7].parse().ok()?,
            })
        })
        .collect()
}

/// The `sh` blocks of the README's walkthrough section, in order.
fn walkthrough_blocks() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let start = readme
        .find("## 60-second walkthrough")
        .expect("README has a 60-second walkthrough");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    section
        .split("```sh\n")
        .skip(1)
        .map(|b| b[..b.find("```").expect("closed code block")].to_owned())
        .collect()
}

struct Ports {
    proxy: SocketAddr,
    admin: SocketAddr,
    receiver: SocketAddr,
}

/// The README's commands pointed at this test's ports and binary.
fn localize(block: &str, p: &Ports) -> String {
    let bin = format!("'{BIN}'");
    block
        .replace("cargo run --release --", &bin)
        .replace("127.0.0.1:8080", &p.proxy.to_string())
        .replace("127.0.0.1:9090", &p.admin.to_string())
        .replace("127.0.0.1:9000", &p.receiver.to_string())
}

/// Runs one walkthrough block with bash; returns stdout and stderr together.
fn run_block(block: &str, p: &Ports) -> String {
    let script = localize(block, p);
    assert!(
        !script.contains("cargo "),
        "unlocalized command in:\n{script}"
    );
    let mut bash = Command::new("bash");
    bash.args(["-euo", "pipefail", "-c", &script])
        .current_dir(ROOT);
    let out = output_within(&mut bash, Duration::from_secs(60));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "step failed:\n{script}\n{text}");
    text
}

/// Starts the receiver and sluice the way the walkthrough's first two blocks do.
fn start(blocks: &[String]) -> (Proc, Proc, Ports) {
    assert!(
        blocks[0].contains("cargo run --release -- demo-receiver --listen 127.0.0.1:9000"),
        "first block starts the receiver:\n{}",
        blocks[0]
    );
    assert!(
        blocks[1].contains("cargo run --release -- run --config config/demo.toml"),
        "second block starts sluice with the demo config:\n{}",
        blocks[1]
    );
    let mut cmd = Command::new(BIN);
    cmd.args(["demo-receiver", "--listen", "127.0.0.1:0"]);
    let receiver = Proc::spawn(cmd, false);
    let receiver_addr: SocketAddr = receiver.wait_for("the receiver's address", |lines| {
        lines.iter().find_map(|l| {
            l.strip_prefix("demo receiver listening on http://")?
                .parse()
                .ok()
        })
    });

    let demo = std::fs::read_to_string(Path::new(ROOT).join("config/demo.toml")).unwrap();
    let ported = demo
        .replace("listen = \"127.0.0.1:8080\"", "listen = \"127.0.0.1:0\"")
        .replace(
            "admin_listen = \"127.0.0.1:9090\"",
            "admin_listen = \"127.0.0.1:0\"",
        );
    assert_eq!(
        ported.matches("127.0.0.1:0\"").count(),
        2,
        "ports in demo.toml"
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("demo.toml");
    std::fs::write(&config, ported).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["--log-format", "json", "run", "--config"])
        .arg(&config);
    let sluice = Proc::spawn(cmd, true);
    let (proxy, admin) = sluice.wait_for("sluice listening", |lines| {
        lines.iter().find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let addr = |k: &str| v.get(k)?.as_str()?.parse::<SocketAddr>().ok();
            Some((addr("proxy_addr")?, addr("admin_addr")?))
        })
    });
    let ports = Ports {
        proxy,
        admin,
        receiver: receiver_addr,
    };
    (receiver, sluice, ports)
}

#[test]
fn the_readme_walkthrough_shows_pacing_a_503_and_a_429_cooldown() {
    let blocks = walkthrough_blocks();
    assert_eq!(
        blocks.len(),
        5,
        "receiver, sluice, three steps: {blocks:#?}"
    );
    let (receiver, _sluice, ports) = start(&blocks);

    // Step 1: 10 at once against 5/s, burst 2, max_wait 1s.
    let out = run_block(&blocks[2], &ports);
    let codes: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(codes.len(), 10, "{out}");
    let sent = codes.iter().filter(|l| l.starts_with("200 ")).count();
    let refused = codes
        .iter()
        .filter(|l| l.starts_with("503 rate_limited "))
        .count();
    assert_eq!(sent + refused, 10, "{out}");
    assert!(refused >= 1, "nothing refused: {out}");
    assert!(sent >= 5, "too few sent: {out}");
    let hello = receiver.wait_for("every sent request at the receiver", |lines| {
        let a = arrivals(lines);
        (a.len() >= sent).then_some(a)
    });
    assert_eq!(hello.len(), sent, "a refused request reached the receiver");
    assert!(
        hello
            .iter()
            .all(|a| a.target == "/hello" && a.status == 200)
    );
    // Paced, measured at the receiver: n arrivals span at least (n - burst)/rate, less
    // JITTER: a request's trip from its grant to the receiver varies (the first ones
    // open fresh connections on a loaded machine).
    const JITTER: f64 = 0.25;
    for i in 0..hello.len() {
        for j in i + 1..hello.len() {
            let n = (j - i + 1) as f64;
            let span = hello[j].t - hello[i].t;
            assert!(
                n <= 5.0 * (span + JITTER) + 2.0,
                "{n} arrivals in {span:.3}s: {hello:?}"
            );
        }
    }
    let span = hello[sent - 1].t - hello[0].t;
    assert!(
        span >= (sent as f64 - 2.0) / 5.0 - JITTER,
        "{sent} arrivals in {span:.3}s: not paced at 5/s: {hello:?}"
    );

    // Step 2: a 429 with Retry-After: 3 holds the endpoint for 3 s.
    let out = run_block(&blocks[3], &ports);
    assert!(out.contains("429 from the receiver"), "{out}");
    assert!(
        out.to_ascii_lowercase()
            .contains("x-sluice-reason: cooldown"),
        "{out}"
    );
    let demo_row = out
        .lines()
        .find(|l| l.starts_with("demo "))
        .unwrap_or_else(|| panic!("no status row: {out}"));
    assert!(demo_row.contains("2.50"), "rate not halved: {demo_row}");
    assert!(out.contains("200 after the cooldown"), "{out}");
    let after = receiver.wait_for("the 429 and the request after the cooldown", |lines| {
        let a = arrivals(lines);
        (a.len() >= sent + 2).then(|| a[sent..].to_vec())
    });
    assert_eq!(
        after.len(),
        2,
        "the cooldown let a request through: {after:?}"
    );
    assert_eq!(
        (after[0].target.as_str(), after[0].status),
        ("/429?retry_after=3", 429)
    );
    assert_eq!(after[1].target, "/hello");
    let quiet = after[1].t - after[0].t;
    assert!(
        quiet >= 3.0 - 0.002,
        "receiver heard again {quiet:.3}s after its 429 with Retry-After: 3"
    );

    // Step 3: the metrics name what happened.
    let out = run_block(&blocks[4], &ports);
    for want in [
        "sluice_requests_total{endpoint=\"demo\",outcome=\"rate_limited\"}",
        "sluice_requests_total{endpoint=\"demo\",outcome=\"cooldown\"} 1",
        "sluice_upstream_throttles_total{endpoint=\"demo\"} 1",
        "sluice_build_info{version=",
    ] {
        assert!(out.contains(want), "no {want} in:\n{out}");
    }
}
