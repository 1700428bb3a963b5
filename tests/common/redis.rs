//! Private Redis servers for tests: a single node or a 3-master cluster, each on free
//! ports with its own temp directory, signalled and killed only through their own child
//! handles (never the Redis that may already listen on 6379). Each server is held by a
//! [`ChildGuard`]: it dies with the test, panicking or not.
//!
//! Use from a test file as `common::redis::RedisServer` (with `mod common;`).
//! Needs `redis-server` and `redis-cli` on PATH (`.ci/run` installs them), both built
//! with TLS for the `rediss://` tests (Debian's are).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
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

/// A test PKI for Redis over TLS, made with rcgen: a CA, a server certificate for
/// 127.0.0.1/localhost and a client certificate, as PEM files in a temp dir.
pub struct RedisTls {
    _dir: tempfile::TempDir,
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server_cert: PathBuf,
    /// The server's key.
    pub server_key: PathBuf,
    /// A client certificate the CA signed (for mutual TLS).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
}

impl RedisTls {
    /// Generates the CA and both certificates.
    pub fn generate() -> Arc<RedisTls> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let write = |name: &str, pem: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).expect("write PEM");
            p
        };
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "redis test CA");
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().unwrap();
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(names).unwrap();
            // A cluster node is a server and (to its peers) a client.
            params.extended_key_usages = vec![usage, ExtendedKeyUsagePurpose::ClientAuth];
            let cert = params.signed_by(&key, &issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) =
            leaf(vec!["sluice".into()], ExtendedKeyUsagePurpose::ClientAuth);
        Arc::new(RedisTls {
            ca: write("ca.pem", ca_pem),
            server_cert: write("server.pem", server_cert),
            server_key: write("server.key", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client.key", client_key),
            _dir: dir,
        })
    }

    /// `[store]` lines for sluice: the CA, and the client certificate when `mutual`.
    pub fn store_keys(&self, mutual: bool) -> String {
        let mut s = format!("tls_ca_file = \"{}\"\n", self.ca.display());
        if mutual {
            s.push_str(&format!(
                "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
                self.client_cert.display(),
                self.client_key.display()
            ));
        }
        s
    }

    fn cli_args(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec!["--tls".into(), "--cacert".into()];
        v.push(self.ca.clone().into());
        v.push("--cert".into());
        v.push(self.client_cert.clone().into());
        v.push("--key".into());
        v.push(self.client_key.clone().into());
        v
    }
}

/// How a test Redis listens and who may talk to it.
#[derive(Clone, Default)]
pub struct Options {
    /// TLS only (`--port 0 --tls-port P`), with the client-certificate policy
    /// (`--tls-auth-clients`: "yes", "no" or "optional").
    pub tls: Option<(Arc<RedisTls>, &'static str)>,
    /// `--requirepass`.
    pub password: Option<String>,
    /// `--replicaof 127.0.0.1 <port>`.
    pub replica_of: Option<u16>,
    /// A sentinel (`--sentinel`) monitoring (master name, master port) with quorum 2,
    /// `down-after-milliseconds` 1000 and `failover-timeout` 3000.
    pub sentinel_of: Option<(String, u16)>,
    /// Cluster nodes only: `--cluster-require-full-coverage no`, so the live masters
    /// keep serving their slots while another master is down (as many managed clusters
    /// are set up).
    pub partial_coverage: bool,
}

impl Options {
    /// TLS with the given `--tls-auth-clients` policy.
    pub fn tls(tls: &Arc<RedisTls>, auth_clients: &'static str) -> Options {
        Options {
            tls: Some((Arc::clone(tls), auth_clients)),
            ..Options::default()
        }
    }

    /// Password-protected (`--requirepass`).
    pub fn password(password: &str) -> Options {
        Options {
            password: Some(password.to_owned()),
            ..Options::default()
        }
    }

    /// A replica of `master`.
    pub fn replica_of(master: &RedisServer) -> Options {
        Options {
            replica_of: Some(master.port),
            ..Options::default()
        }
    }

    /// A sentinel watching `master` under the name `name`.
    pub fn sentinel_of(name: &str, master: &RedisServer) -> Options {
        Options {
            sentinel_of: Some((name.to_owned(), master.port)),
            ..Options::default()
        }
    }

    fn server_args(&self, port: u16, cluster: bool) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        let port = port.to_string();
        match &self.tls {
            None => v.extend(["--port", &port].map(OsString::from)),
            Some((t, auth)) => {
                v.extend(["--port", "0", "--tls-port", &port].map(OsString::from));
                v.extend(["--tls-auth-clients", auth].map(OsString::from));
                for (flag, path) in [
                    ("--tls-cert-file", &t.server_cert),
                    ("--tls-key-file", &t.server_key),
                    ("--tls-ca-cert-file", &t.ca),
                ] {
                    v.push(flag.into());
                    v.push(path.clone().into());
                }
                if cluster {
                    v.extend(
                        ["--tls-cluster", "yes", "--tls-replication", "yes"].map(OsString::from),
                    );
                }
            }
        }
        if let Some(p) = &self.password {
            v.extend(["--requirepass".into(), p.into()]);
        }
        if let Some(master) = self.replica_of {
            v.extend(["--replicaof", "127.0.0.1", &master.to_string()].map(OsString::from));
        }
        v
    }

    fn cli_args(&self) -> Vec<OsString> {
        let mut v = self
            .tls
            .as_ref()
            .map_or_else(Vec::new, |(t, _)| t.cli_args());
        if let Some(p) = &self.password {
            v.extend(["-a".into(), p.into(), "--no-auth-warning".into()]);
        }
        v
    }
}

fn redis_cli(port: u16, opts: &Options, args: &[&str]) -> Option<String> {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(opts.cli_args());
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
    opts: Options,
}

impl RedisServer {
    /// Starts a single node on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::spawn(false, Options::default())
    }

    /// Starts a single node that requires `password` (`--requirepass`).
    pub fn start_with_password(password: &str) -> RedisServer {
        RedisServer::spawn(false, Options::password(password))
    }

    /// Starts a single node with `opts` (TLS, password, replica, sentinel).
    pub fn start_with(opts: Options) -> RedisServer {
        RedisServer::spawn(false, opts)
    }

    fn spawn(cluster: bool, opts: Options) -> RedisServer {
        let mut dir = tempfile::tempdir().expect("temp dir");
        for _ in 0..PORT_ATTEMPTS {
            let mut s = RedisServer {
                child: None,
                port: free_port(),
                dir,
                cluster,
                opts: opts.clone(),
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
        if let Some((name, master)) = &self.opts.sentinel_of {
            // Sentinels rewrite their config file: each gets its own, in its own dir.
            let conf = self.dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "sentinel monitor {name} 127.0.0.1 {master} 2\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 3000\n\
                     sentinel parallel-syncs {name} 1\n"
                ),
            )
            .expect("write sentinel.conf");
            cmd.arg(conf).arg("--sentinel");
        }
        cmd.args(self.opts.server_args(self.port, self.cluster))
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(self.dir.path().join("nodes.conf"));
            if self.opts.partial_coverage {
                cmd.args(["--cluster-require-full-coverage", "no"]);
            }
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

    /// `redis://127.0.0.1:PORT/` (`rediss://` with TLS), with the password when there is
    /// one.
    pub fn url(&self) -> String {
        let scheme = if self.opts.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        match &self.opts.password {
            Some(p) => format!("{scheme}://:{p}@127.0.0.1:{}/", self.port),
            None => format!("{scheme}://127.0.0.1:{}/", self.port),
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
        redis_cli(self.port, &self.opts, args)
    }

    /// Starts `redis-cli MONITOR` on this server (a child of ours, killed by
    /// [`Monitor::stop`] or on drop) and waits until it is attached.
    pub fn monitor(&self) -> Monitor {
        let file = tempfile::NamedTempFile::new().expect("temp file");
        let out = file.reopen().expect("reopen temp file");
        let child = ChildGuard::spawn(
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(self.opts.cli_args())
                .arg("MONITOR")
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(Stdio::null()),
        );
        let m = Monitor {
            child: Some(child),
            file,
        };
        // Attached once a marker command shows up in its output.
        wait_until("MONITOR attached", Duration::from_secs(10), || {
            self.cli(&["ECHO", "monitor-attached"]);
            m.text().contains("monitor-attached")
        });
        m
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

    /// Stops `monitor` once it has logged every command this server ran so far (a
    /// marker sent after them shows up in it) and returns that log.
    pub fn monitor_log(&self, monitor: Monitor) -> String {
        self.cli(&["ECHO", "caught-up"]).unwrap();
        wait_until("MONITOR caught up", Duration::from_secs(10), || {
            monitor.text().contains("caught-up")
        });
        monitor.stop()
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
    /// The nodes: the three masters, then (with [`start_with_replicas`](Self::start_with_replicas))
    /// one replica of each, as `redis-cli --cluster create` paired them.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled nodes, creates the cluster, waits for
    /// `cluster_state:ok` on every node.
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(Options::default())
    }

    /// Like [`start`](Self::start), every node with `opts` (with TLS, the cluster bus
    /// and replication use TLS too).
    pub fn start_with(opts: Options) -> RedisCluster {
        RedisCluster::create(opts, 0)
    }

    /// Like [`start`](Self::start), with `cluster-require-full-coverage no`: while one
    /// master is down, the others keep serving their slots.
    pub fn start_partial() -> RedisCluster {
        RedisCluster::start_with(Options {
            partial_coverage: true,
            ..Options::default()
        })
    }

    /// Three masters and a replica of each (six nodes), as managed clusters run: a
    /// master that dies is replaced by its replica once the others mark it failed
    /// (`cluster-node-timeout` 2 s).
    pub fn start_with_replicas() -> RedisCluster {
        RedisCluster::create(Options::default(), 1)
    }

    fn create(opts: Options, replicas: usize) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| RedisServer::spawn(true, opts.clone()))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = super::process::output_within(
            Command::new("redis-cli")
                .args(opts.cli_args())
                .arg("--cluster")
                .arg("create")
                .args(&addrs)
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]),
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
            // A replica that never synced with its master would not take over from it.
            wait_until("replicas in sync", Duration::from_secs(30), || {
                n.cli(&["INFO", "replication"]).is_some_and(|i| {
                    !i.contains("role:slave") || i.contains("master_link_status:up")
                })
            });
        }
        RedisCluster { nodes }
    }

    /// Seed URLs of all nodes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The hash slot of `key` (as Redis computes it), asked of a node that answers.
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|n| n.cli(&["CLUSTER", "KEYSLOT", key]))
            .and_then(|s| s.parse().ok())
            .expect("CLUSTER KEYSLOT")
    }

    /// An endpoint ID (`ep0`, `ep1`, …) whose keys (`sluice:{<id>}`) live on the master
    /// at `port` (`on`), or on another master (`!on`).
    pub fn endpoint(&self, port: u16, on: bool) -> String {
        (0..1000)
            .map(|i| format!("ep{i}"))
            .find(|n| (self.node_for(&format!("sluice:{{{n}}}")).port() == port) == on)
            .expect("an endpoint ID on that side")
    }

    /// The master that serves `key`'s slot, as a node that answers sees it.
    pub fn node_for(&self, key: &str) -> &RedisServer {
        let slot = self.slot(key);
        let nodes = self
            .nodes
            .iter()
            .find_map(|n| n.cli(&["CLUSTER", "NODES"]))
            .unwrap_or_default();
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

/// A master, one replica and three sentinels (quorum 2) on free ports; dropped, all are
/// killed.
pub struct SentinelSet {
    /// The master at start.
    pub master: RedisServer,
    /// Its replica (promoted when the master dies).
    pub replica: RedisServer,
    /// The sentinels.
    pub sentinels: Vec<RedisServer>,
    /// The name the sentinels monitor.
    pub name: String,
}

impl SentinelSet {
    /// Starts everything and waits until the replica is in sync and every sentinel knows
    /// the replica and the two other sentinels.
    pub fn start(name: &str) -> SentinelSet {
        let master = RedisServer::start();
        let replica = RedisServer::start_with(Options::replica_of(&master));
        wait_until("the replica in sync", Duration::from_secs(20), || {
            replica
                .cli(&["INFO", "replication"])
                .is_some_and(|i| i.contains("master_link_status:up"))
        });
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_with(Options::sentinel_of(name, &master)))
            .collect();
        for s in &sentinels {
            wait_until(
                "sentinels to know each other",
                Duration::from_secs(30),
                || {
                    s.cli(&["INFO", "sentinel"]).is_some_and(|i| {
                        i.contains("status=ok") && i.contains("slaves=1,sentinels=3")
                    })
                },
            );
        }
        SentinelSet {
            master,
            replica,
            sentinels,
            name: name.to_owned(),
        }
    }

    /// `redis://127.0.0.1:PORT/` of every sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// Whether the (former) replica now says it is the master.
    pub fn replica_promoted(&self) -> bool {
        self.replica
            .cli(&["ROLE"])
            .is_some_and(|r| r.lines().next() == Some("master"))
    }
}

/// A running `redis-cli MONITOR`, its output in a temp file.
pub struct Monitor {
    child: Option<ChildGuard>,
    file: tempfile::NamedTempFile,
}

impl Monitor {
    /// What it has logged so far.
    pub fn text(&self) -> String {
        std::fs::read_to_string(self.file.path()).unwrap_or_default()
    }

    /// Stops it (by its handle) and returns every command line it saw.
    pub fn stop(mut self) -> String {
        self.kill();
        self.text()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }
}

/// Calls of any script (`EVALSHA`) `server` has run so far, from `INFO commandstats`.
pub fn evalsha_calls(server: &RedisServer) -> u64 {
    command_calls(server, "evalsha")
}

/// How many times `server` ran `command` (lower case), scripts' commands included.
pub fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]).unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    stats
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|l| l.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// `lua/acquire.lua` as sluice sends it (after the bucket prelude), to call directly.
pub fn acquire_script() -> redis::Script {
    redis::Script::new(concat!(
        include_str!("../../lua/bucket.lua"),
        include_str!("../../lua/acquire.lua")
    ))
}

/// What a replica sends `acquire.lua` before its asks (ARGV[1]–ARGV[11], see the
/// script): no recovery, no heartbeat set, no windows, every ask costing 1.
#[allow(dead_code)]
pub struct AcquireArgs {
    pub rate: f64,
    pub burst: f64,
    /// Tokens wanted ahead, and how long (µs) the script counts them held.
    pub ahead: u32,
    pub held_for_us: u64,
    /// How long (µs) the replica heard the bucket stays busy, and the writes it heard.
    pub known_us: u64,
    pub seen: u64,
}

#[allow(dead_code)]
impl AcquireArgs {
    /// A call of `script` (`acquire_script`) on `key` with these arguments; the asks
    /// (budget, held generation) follow as further `arg`s.
    pub fn call<'a>(&self, script: &'a redis::Script, key: &str) -> redis::ScriptInvocation<'a> {
        let mut inv = script.key(key);
        inv.arg(self.rate)
            .arg(self.burst)
            .arg(0)
            .arg(self.ahead)
            .arg(self.held_for_us)
            .arg("")
            .arg(0)
            .arg(self.known_us)
            .arg(self.seen)
            .arg("")
            .arg("");
        inv
    }
}

/// `lua/release.lua` as sluice sends it.
pub fn release_script() -> redis::Script {
    redis::Script::new(concat!(
        include_str!("../../lua/bucket.lua"),
        include_str!("../../lua/release.lua")
    ))
}

/// A connection of the test's own to `server`, to call scripts and commands directly.
pub async fn connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// What `acquire.lua` calls asked Redis, from a MONITOR log:
/// `(reservations, confirmations, script calls)`. A call is `EVALSHA <acquire sha> <n>
/// <n keys> rate burst recovery ahead ahead_us replica ttl busy writes windows costs` followed by one `budget held` pair per ask
/// (several when concurrent asks were batched); a confirmation carries a held
/// generation, a reservation `""`.
pub fn acquires(monitor: &str) -> (usize, usize, usize) {
    let mut calls = (0, 0, 0);
    for words in calls_of(monitor, &acquire_script()) {
        calls.2 += 1;
        let keys: usize = words[2].trim_matches('"').parse().unwrap();
        for pair in words[3 + keys + 11..].chunks(2) {
            if pair.get(1) == Some(&"\"\"") {
                calls.0 += 1;
            } else {
                calls.1 += 1;
            }
        }
    }
    calls
}

/// Tokens given back unspent after being taken ahead, from a MONITOR log: the sum of
/// the counts of `release.lua` calls that name a hold (`EVALSHA <release sha> 1 <key>
/// rate burst recovery generation n hold`; a reservation's give-back names none).
pub fn given_back_ahead(monitor: &str) -> u64 {
    let mut n = 0;
    for words in calls_of(monitor, &release_script()) {
        let hold = words.get(9).map(|w| w.trim_matches('"')).unwrap_or("");
        if !hold.is_empty() {
            n += words[8].trim_matches('"').parse::<u64>().unwrap_or(0);
        }
    }
    n
}

/// The `EVALSHA` calls of `script` in a MONITOR log (not those made from Lua), each as
/// its words (quoted as MONITOR quotes them).
fn calls_of<'a>(monitor: &'a str, script: &redis::Script) -> Vec<Vec<&'a str>> {
    let quoted = format!("\"{}\"", script.get_hash());
    monitor
        .lines()
        .filter(|l| !l.contains("lua]"))
        .filter_map(|line| line.split_once("] ").map(|(_, c)| c))
        .map(|cmd| cmd.split_whitespace().collect::<Vec<&str>>())
        .filter(|w| w.first() == Some(&"\"EVALSHA\"") && w.get(1) == Some(&quoted.as_str()))
        .collect()
}
