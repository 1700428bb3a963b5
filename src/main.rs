//! The `sluice` binary: parses the command line, then calls the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sluice::admin::EndpointView;
use sluice::app::ReloadError;
use sluice::config::{Config, ConfigError};

mod top;

#[derive(Parser)]
#[command(
    name = "sluice",
    version = sluice::version::LONG,
    about = "HTTP forward proxy that keeps the rate limits receivers publish"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy and its admin listener.
    Run {
        /// Config file (TOML); required, here or in SLUICE_CONFIG.
        #[arg(long, env = "SLUICE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Validate a config file and print a one-line summary.
    Check {
        /// Config file (TOML); required, here or in SLUICE_CONFIG.
        #[arg(long, env = "SLUICE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Manage the interception CA.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
    /// Print the endpoints of a running sluice.
    Status {
        /// Admin listener URL.
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
        /// The file holding the admin token, when the admin listener asks for one
        /// (`proxy.admin_token_file` of the running sluice).
        #[arg(long, env = "SLUICE_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
    },
    /// Show the endpoints of a running sluice live in the terminal, sorted by what
    /// waits: `s`/`S` sort by another column, `r` reverses, `/` filters by ID, `q` quits.
    Top {
        /// Admin listener URL.
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// The file holding the admin token, when the admin listener asks for one
        /// (`proxy.admin_token_file` of the running sluice).
        #[arg(long, env = "SLUICE_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
    },
    /// List the receiver profiles an endpoint's `profile` may name, or print one as
    /// config (`profiles show NAME`).
    Profiles {
        #[command(subcommand)]
        command: Option<ProfilesCommand>,
    },
    /// Print the version, git commit and build date (same as --version).
    Version,
    /// Run a tiny webhook receiver for trying sluice offline: 200 on any path,
    /// 429 on /429?retry_after=N, slow on /slow?ms=N; prints one line per request.
    DemoReceiver {
        /// Address to listen on (port 0 picks a free port).
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: std::net::SocketAddr,
    },
    /// Print an htpasswd line (`user:bcrypt-hash`) for security.auth_users_file; the
    /// password is read from the first line of standard input.
    Passwd {
        /// The proxy user name.
        user: String,
        /// bcrypt cost (work factor), 4–31.
        #[arg(long, default_value_t = 10)]
        cost: u32,
    },
}

#[derive(Subcommand)]
enum ProfilesCommand {
    /// Print a receiver profile as an `[[endpoints]]` entry, with where its figures
    /// come from.
    Show {
        /// The profile's name (`sluice profiles` lists them).
        name: String,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Write a new CA (ca.pem, ca.key) into DIR; refuses to overwrite.
    Init {
        /// Directory for ca.pem and ca.key.
        #[arg(long)]
        dir: PathBuf,
    },
}

/// `sluice profiles`: one line per receiver profile; `show NAME`: one as config.
fn profiles(command: Option<ProfilesCommand>) -> anyhow::Result<ExitCode> {
    match command {
        None => {
            for p in sluice::config::RECEIVERS {
                let meta = p.meta();
                println!(
                    "{:<10} {}  ({}, read {})",
                    p.name, meta.receiver, meta.source, meta.read
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(ProfilesCommand::Show { name }) => match sluice::config::receiver(&name) {
            Some(p) => {
                print!("{}", p.as_config());
                Ok(ExitCode::SUCCESS)
            }
            None => {
                let names: Vec<&str> = sluice::config::RECEIVERS.iter().map(|p| p.name).collect();
                eprintln!(
                    "error: no receiver profile \"{name}\"; known: {}",
                    names.join(", ")
                );
                Ok(ExitCode::from(1))
            }
        },
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // `--help` and `--version` print and exit 0; a usage error exits 1 (SPEC), not
        // clap's 2, which sluice keeps for failures at run time.
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::from(e.use_stderr()));
        }
    };
    // `run` sets up its logs once it has read `[log]`; every other command logs to
    // stderr. The guard flushes what is still queued when it drops, at exit.
    let _logs = match cli.command {
        Command::Run { .. } => None,
        _ => Some(init_logs(cli.log_format, None, DEFAULT_LOG_LINES)),
    };
    let result = match cli.command {
        Command::Check { config } => config_path(config).map_or_else(usage, |c| check(&c)),
        Command::Run { config } => {
            config_path(config).map_or_else(usage, |c| run(&c, cli.log_format))
        }
        Command::Ca {
            command: CaCommand::Init { dir },
        } => ca_init(&dir),
        Command::Status {
            admin,
            json,
            admin_token_file,
        } => status(&admin, json, admin_token_file.as_deref()),
        Command::Top {
            admin,
            admin_token_file,
        } => top_command(&admin, admin_token_file.as_deref()),
        Command::DemoReceiver { listen } => demo_receiver(listen),
        Command::Version => {
            println!("sluice {}", sluice::version::LONG);
            Ok(ExitCode::SUCCESS)
        }
        Command::Passwd { user, cost } => passwd(&user, cost),
        Command::Profiles { command } => profiles(command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A usage error (no config named): said, exit 1.
fn usage(e: anyhow::Error) -> anyhow::Result<ExitCode> {
    eprintln!("error: {e:#}");
    Ok(ExitCode::from(1))
}

/// The config file to use: there is no default, so nothing ever runs on a config its
/// operator did not choose (an example's limits in production, say).
fn config_path(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    given.ok_or_else(|| {
        anyhow::anyhow!(
            "no config file: pass --config FILE or set SLUICE_CONFIG=FILE \
             (to try sluice: --config config/sluice.example.toml, or in the image \
             --config /etc/sluice/example.toml)"
        )
    })
}

/// `[log] buffer_lines` of the commands that read no config.
const DEFAULT_LOG_LINES: usize = 128_000;

/// Sends every tracing line to a background writer over `file` (stderr when `None`),
/// at most `lines` of them queued; the guard flushes the queue when dropped.
fn init_logs(
    format: LogFormat,
    file: Option<std::fs::File>,
    lines: usize,
) -> sluice::logging::WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for people: no ANSI codes in files, pipes and log collectors.
    let colour = file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (writer, guard) = sluice::logging::writer(file, lines);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    guard
}

/// Opens `[log] file` (when set) for appending; the error names the key.
fn open_log_file(c: &Config) -> Result<Option<std::fs::File>, String> {
    c.log
        .file
        .as_deref()
        .map(|p| {
            sluice::logging::open(p)
                .map_err(|e| format!("log.file: cannot open {} for appending: {e}", p.display()))
        })
        .transpose()
}

/// Loads a config and opens every file it names; exit 1 naming the key when one fails.
fn load(path: &Path) -> Result<Config, ExitCode> {
    let config = Config::load(path).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(1)
    })?;
    config.check_files().map_err(|issues| {
        let path = path.to_owned();
        eprintln!("{}", ConfigError::Files { path, issues });
        ExitCode::from(1)
    })?;
    Ok(config)
}

/// The TLS files must hold what their keys promise (a CA and its key, PEM roots).
fn check_tls(c: &Config) -> Result<(), String> {
    sluice::tls::client_config(&c.tls.upstream_roots)
        .map_err(|e| format!("tls.upstream_roots: {e}"))?;
    if c.tls.intercept {
        sluice::tls::CertAuthority::load(&c.tls.ca_cert, &c.tls.ca_key)
            .map_err(|e| format!("tls.ca_cert / tls.ca_key: {e}"))?;
    }
    Ok(())
}

fn check(path: &Path) -> anyhow::Result<ExitCode> {
    Ok(match load(path) {
        Ok(c) => {
            // Files the config names are opened and parsed now, not at the first connect.
            if let Err(e) = sluice::limiter::redis::tls_certificates(&c.store.tls) {
                eprintln!("{}: {e}", path.display());
                return Ok(ExitCode::from(1));
            }
            let summary = c.summary();
            let warnings = c.warnings.clone();
            if let Err(e) = open_log_file(&c) {
                eprintln!("{}: {e}", path.display());
                return Ok(ExitCode::from(1));
            }
            let (open_proxy, allow_anonymous) = (c.open_proxy(), c.security.allow_anonymous);
            if let Err(e) = check_tls(&c) {
                eprintln!("{}: {e}", path.display());
                return Ok(ExitCode::from(1));
            }
            // The files it names (users, admin token) must be usable too.
            if let Err(e) = sluice::core::Runtime::load(std::sync::Arc::new(c)) {
                eprintln!("{}: {e}", path.display());
                return Ok(ExitCode::from(1));
            }
            // What loads but would misbehave (a wait budget the sender's platform times
            // out before) is said, without failing the check.
            for w in &warnings {
                eprintln!("{}: warning: {w}", path.display());
            }
            // An open proxy: refused as `run` refuses it, or, when the operator said so,
            // said loudly.
            if let Some(open) = open_proxy {
                eprintln!(
                    "{}: {}",
                    path.display(),
                    open_proxy_line(&open, allow_anonymous)
                );
                if !allow_anonymous {
                    return Ok(ExitCode::from(1));
                }
            }
            println!("{}: {summary}", path.display());
            ExitCode::SUCCESS
        }
        Err(code) => code,
    })
}

/// What `check` and `run` say of a config that makes sluice an open proxy
/// ([`Config::open_proxy`]): an error unless `security.allow_anonymous = true`, else a
/// warning; either way, how to close it.
fn open_proxy_line(open: &str, allowed: bool) -> String {
    let close = "set security.allowed_hosts to the receivers' hosts, or security.auth_users_file \
                 (proxy authentication), or listen on 127.0.0.1";
    if allowed {
        format!(
            "warning: OPEN PROXY: {open} (security.allow_anonymous = true); to close it, {close}"
        )
    } else {
        format!(
            "error: {open}. Refusing to run an open proxy: {close}; or, if every host that \
             can reach the port may use it, set security.allow_anonymous = true"
        )
    }
}

fn ca_init(dir: &Path) -> anyhow::Result<ExitCode> {
    match sluice::tls::generate_ca(dir) {
        Ok(files) => {
            println!(
                "wrote {} and {} (mode 0600)",
                files.cert.display(),
                files.key.display()
            );
            println!("trust it in senders, e.g.:");
            println!(
                "  curl --proxy http://127.0.0.1:8080 --cacert {} https://...",
                files.cert.display()
            );
            println!(
                "  SSL_CERT_FILE / REQUESTS_CA_BUNDLE / NODE_EXTRA_CA_CERTS={}",
                files.cert.display()
            );
            println!(
                "keep {} secret: anyone holding it can impersonate any site to your senders",
                files.key.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

fn run(path: &Path, format: LogFormat) -> anyhow::Result<ExitCode> {
    // Before reading: an edit from here on is one the file watch reloads.
    let seen = modified(path);
    let config = match load(path) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    let file = match open_log_file(&config) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            return Ok(ExitCode::from(1));
        }
    };
    // Held until `run` returns, after the drain: dropping it writes out what is queued.
    let _logs = init_logs(format, file, config.log.buffer_lines);
    for w in &config.warnings {
        tracing::warn!("{}: {w}", path.display());
    }
    if let Some(open) = config.open_proxy() {
        let line = open_proxy_line(&open, config.security.allow_anonymous);
        if !config.security.allow_anonymous {
            eprintln!("{}: {line}", path.display());
            return Ok(ExitCode::from(1));
        }
        tracing::warn!("{}: {line}", path.display());
    }
    // Sender connections run on the workers; the main thread accepts, answers the
    // admin listener and runs the background jobs.
    let workers = sluice::workers::Workers::start(config.proxy.workers, config.proxy.pin_workers)
        .context("starting the worker threads")?;
    match workers.pinned() {
        Some(cpus) => tracing::info!(
            workers = workers.len(),
            ?cpus,
            "workers started, one per CPU"
        ),
        None => tracing::info!(workers = workers.len(), "workers started"),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(
        path.to_owned(),
        config,
        seen,
        std::sync::Arc::new(workers),
    ))
}

/// Runs sluice on `config` (read from `path`, which had the modification time `seen`
/// then) until SIGTERM or SIGINT, reloading on SIGHUP and when the file changes.
async fn serve(
    path: PathBuf,
    config: Config,
    mut seen: Option<SystemTime>,
    workers: std::sync::Arc<sluice::workers::Workers>,
) -> anyhow::Result<ExitCode> {
    use tokio::signal::unix::{SignalKind, signal};
    // Taken before start-up, which may wait for the store while the listeners are
    // already bound: a SIGHUP then (a hook that fires on "port open") is a reload once
    // started, not the end of the process.
    let mut hup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;
    let mut running = match sluice::app::start_on(config, Some(workers)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            // A file the config names that `check` would refuse is bad config (1), as
            // `check` says; the rest are failures at run time (2).
            let bad_config = matches!(e, sluice::app::StartError::Files(_));
            return Ok(ExitCode::from(if bad_config { 1 } else { 2 }));
        }
    };
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let app = std::sync::Arc::clone(&running.app);
    // The file is looked at once a second, the first time a second from now (the
    // version read at start is `seen`).
    let every = Duration::from_secs(1);
    let mut poll = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            // SIGTERM / SIGINT: drain and exit 0.
            _ = term.recv() => break,
            _ = int.recv() => break,
            // SIGHUP: reload now. The watch below then takes this version of the file as
            // seen, so one edit followed by a SIGHUP reloads (and logs) once.
            _ = hup.recv() => {
                seen = modified(&path);
                reload(&app, &path, "SIGHUP");
            }
            // The file changed on disk: reload.
            _ = poll.tick() => {
                let now = modified(&path);
                if now != seen {
                    seen = now;
                    reload(&app, &path, "file changed");
                }
            }
        }
    }
    if let Some(stop) = running.stop_handle() {
        let _ = stop.send(());
    }
    running.wait().await;
    Ok(ExitCode::SUCCESS)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Reloads `path` into `app`, logging a refusal with what asked for the reload (`by`).
fn reload(app: &sluice::core::App, path: &Path, by: &'static str) {
    match sluice::app::reload(app, path) {
        Ok(()) => {
            for w in &app.runtime.load().config.warnings {
                tracing::warn!(by, "{}: {w}", path.display());
            }
        }
        Err(ReloadError::Config(ConfigError::Invalid { issues, .. })) => {
            for i in &issues {
                tracing::error!(error = %i, by, "reload refused: keeping the running config");
            }
        }
        Err(e) => tracing::error!(error = %e, by, "reload refused: keeping the running config"),
    }
}

fn demo_receiver(listen: std::net::SocketAddr) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let (listener, addr) = match sluice::demo::bind(listen).await {
            Ok(bound) => bound,
            Err(e) => {
                eprintln!("error: cannot listen on {listen}: {e}");
                return Ok(ExitCode::from(2));
            }
        };
        println!("demo receiver listening on http://{addr}");
        println!("  /  200   /429?retry_after=N  429 + Retry-After   /slow?ms=N  200 after N ms");
        let ctrl_c = async {
            // Without a handler Ctrl-C still ends the process; either way we stop.
            let _ = tokio::signal::ctrl_c().await;
        };
        sluice::demo::serve(listener, ctrl_c, |r| println!("{r}")).await;
        Ok(ExitCode::SUCCESS)
    })
}

/// The longest password bcrypt checks whole, in bytes.
const MAX_BCRYPT_PASSWORD: usize = 72;

fn passwd(user: &str, cost: u32) -> anyhow::Result<ExitCode> {
    if user.is_empty() || user.contains(['+', ':']) || !user.bytes().all(|b| b.is_ascii_graphic()) {
        eprintln!("user name must be visible ASCII without '+' or ':'");
        return Ok(ExitCode::from(1));
    }
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("reading the password from standard input")?;
    let password = line.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        eprintln!("no password on standard input (e.g. `echo \"$PW\" | sluice passwd {user}`)");
        return Ok(ExitCode::from(1));
    }
    // bcrypt reads a password's first 72 bytes only: a longer one would let in any
    // password that shares them.
    if password.len() > MAX_BCRYPT_PASSWORD {
        eprintln!(
            "the password is {} bytes long: bcrypt checks only the first {MAX_BCRYPT_PASSWORD}, so \
             any password sharing them would be accepted; use at most {MAX_BCRYPT_PASSWORD} bytes",
            password.len()
        );
        return Ok(ExitCode::from(1));
    }
    let hash = bcrypt::hash(password, cost).context("hashing the password")?;
    println!("{user}:{hash}");
    Ok(ExitCode::SUCCESS)
}

/// `sluice top`: the terminal view of `admin`'s endpoints until `q`.
fn top_command(admin: &str, token_file: Option<&Path>) -> anyhow::Result<ExitCode> {
    let token = match token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token file {}", path.display()))?;
            Some(text.trim().to_owned())
        }
        None => None,
    };
    top::run(admin, token).map_err(anyhow::Error::msg)?;
    Ok(ExitCode::SUCCESS)
}

fn status(admin: &str, json: bool, token_file: Option<&Path>) -> anyhow::Result<ExitCode> {
    let token = match token_file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token file {}", path.display()))?;
            Some(text.trim().to_owned())
        }
        None => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let body = rt
        .block_on(sluice::admin::fetch_endpoints(admin, token.as_deref()))
        .map_err(anyhow::Error::msg)?;
    if json {
        println!("{body}");
        return Ok(ExitCode::SUCCESS);
    }
    let views: Vec<EndpointView> = serde_json::from_str(&body)
        .with_context(|| format!("{admin}/endpoints did not return endpoint JSON"))?;
    print!("{}", sluice::admin::render_table(&views));
    Ok(ExitCode::SUCCESS)
}
