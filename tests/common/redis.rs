//! Private Redis servers for tests: a single node or a 3-master cluster, each on free
//! ports with its own temp directory, signalled and killed only through their own child
//! handles (never the Redis that may already listen on 6379). Each server is held by a
//! [`ChildGuard`]: it dies with the test, panicking or not.
//!
//! Use from a test file as `common::redis::RedisServer` (with `mod common;`).
//! Needs `redis-server` and `redis-cli` on PATH (`.ci/run` installs them).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::process::ChildGuard;

/// How long a server may take to answer PING after spawning.
const START_DEADLINE: Duration = Duration::from_secs(10);
/// Longest a redis-cli call may take.
const CLI_DEADLINE: Duration = Duration::from_secs(10);
/// Attempts at finding a free port before giving up (another process may take the port
/// between our probe bind and redis-server's bind).
const PORT_ATTEMPTS: usize = 8;

/// A port free now on 127.0.0.1 whose cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let p = l.local_addr().expect("local_addr").port();
        if p < 55_000 && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
}

fn redis_cli(port: u16, password: Option<&str>, args: &[&str]) -> Option<String> {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if let Some(p) = password {
        cmd.args(["--no-auth-warning", "-a", p]);
    }
    // Bounded: a stopped (SIGSTOP) server would otherwise hang the test forever.
    let out = super::process::output_within(cmd.args(args), CLI_DEADLINE);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Polls `ok` every 20 ms until it holds, panicking after `deadline` (blocking; for
/// async conditions use [`super::wait_for`]).
pub fn wait_until(what: &str, deadline: Duration, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + deadline;
    loop {
        if ok() {
            return;
        }
        assert!(
            Instant::now() < end,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One redis-server child process.
pub struct RedisServer {
    child: Option<ChildGuard>,
    port: u16,
    dir: tempfile::TempDir,
    cluster: bool,
    password: Option<String>,
}

impl RedisServer {
    /// Starts a single node on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::spawn(false, None)
    }

    /// Starts a single node that requires `password` (`--requirepass`).
    pub fn start_with_password(password: &str) -> RedisServer {
        RedisServer::spawn(false, Some(password.to_owned()))
    }

    fn spawn(cluster: bool, password: Option<String>) -> RedisServer {
        let mut dir = tempfile::tempdir().expect("temp dir");
        for _ in 0..PORT_ATTEMPTS {
            let mut s = RedisServer {
                child: None,
                port: free_port(),
                dir,
                cluster,
                password: password.clone(),
            };
            if s.launch() {
                return s;
            }
            // Lost the port to someone else: try another.
            dir = std::mem::replace(&mut s.dir, tempfile::tempdir().expect("temp dir"));
        }
        panic!("could not start redis-server on a free port after {PORT_ATTEMPTS} attempts");
    }

    /// Spawns redis-server on `self.port`; true once *our* child answers PING, false
    /// when it exited (port taken).
    fn launch(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = &self.password {
            cmd.args(["--requirepass", p]);
        }
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(self.dir.path().join("nodes.conf"));
        }
        let mut child = match cmd.spawn() {
            Ok(c) => ChildGuard::from(c),
            Err(e) => panic!(
                "cannot run redis-server ({e}): install it (e.g. `apt-get install redis-server`; \
                 .ci/run does) so the Redis tests can start their own servers"
            ),
        };
        let pid = child.id().to_string();
        let end = Instant::now() + START_DEADLINE;
        loop {
            if let Ok(Some(_)) = child.child().try_wait() {
                return false;
            }
            // Make sure the server answering is ours, not one that holds the port.
            let info = self.cli(&["INFO", "server"]).unwrap_or_default();
            if info
                .lines()
                .any(|l| l.trim() == format!("process_id:{pid}"))
            {
                self.child = Some(child);
                return true;
            }
            if Instant::now() >= end {
                child.kill();
                panic!("redis-server on port {} never answered", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:PORT/`, with the password when there is one.
    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The child's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(ChildGuard::id)
    }

    /// Runs a redis-cli command against this server; `None` when it fails.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        redis_cli(self.port, self.password.as_deref(), args)
    }

    /// SIGKILLs the server (through the child handle) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }

    /// Kills it and starts it again on the same port, empty (no keys, no scripts).
    pub fn restart(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(self.dir.path().join("nodes.conf"));
        self.revive();
    }

    /// Kills it and starts it again on the same port with its data directory as it was:
    /// a cluster node comes back as the same member with the same slots.
    pub fn revive(&mut self) {
        self.kill();
        assert!(
            self.launch(),
            "port {} was taken while starting again",
            self.port
        );
    }

    /// Sends `sig` to our child only (by its pid).
    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([sig, &pid.to_string()])
                .stdin(Stdio::null())
                .status();
        }
    }

    /// SIGSTOP: the server stops answering but keeps its sockets open.
    pub fn stop(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT: a stopped server answers again (and works off what queued meanwhile).
    pub fn cont(&self) {
        self.signal("-CONT");
    }

    /// Same as [`stop`](Self::stop).
    pub fn pause(&self) {
        self.stop();
    }

    /// Same as [`cont`](Self::cont).
    pub fn resume(&self) {
        self.cont();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL; CONT first anyway so nothing lingers.
        self.cont();
        self.kill();
    }
}

/// Three masters joined with `redis-cli --cluster create`; dropped, all are killed.
pub struct RedisCluster {
    /// The masters.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled nodes, creates the cluster, waits for
    /// `cluster_state:ok` on every node.
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::spawn(true, None)).collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = super::process::output_within(
            Command::new("redis-cli")
                .arg("--cluster")
                .arg("create")
                .args(&addrs)
                .args(["--cluster-replicas", "0", "--cluster-yes"]),
            Duration::from_secs(30),
        );
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for n in &nodes {
            wait_until("cluster_state:ok", Duration::from_secs(20), || {
                n.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            });
        }
        RedisCluster { nodes }
    }

    /// Seed URLs of all masters.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The hash slot of `key` (as Redis computes it).
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .and_then(|s| s.parse().ok())
            .expect("CLUSTER KEYSLOT")
    }

    /// The master that serves `key`'s slot.
    pub fn node_for(&self, key: &str) -> &RedisServer {
        let slot = self.slot(key);
        let nodes = self.nodes[0].cli(&["CLUSTER", "NODES"]).unwrap_or_default();
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = f
                .get(1)
                .and_then(|a| a.split(['@', ':']).nth(1))
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            for range in f.iter().skip(8) {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>()) {
                    if (a..=b).contains(&slot) {
                        if let Some(n) = self.nodes.iter().find(|n| n.port == port) {
                            return n;
                        }
                    }
                }
            }
        }
        panic!("no node serves slot {slot}");
    }
}
