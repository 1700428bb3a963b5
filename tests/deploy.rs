//! What ships for deployment: the Docker image refuses to start without a chosen config,
//! and the Helm chart (`deploy/helm/sluice`) has every part operators expect.
//! `deploy/helm/check.py` turns the templates into plain YAML (both branches of every
//! `if`) for the structural checks here; `scripts/check-chart` lints and renders the
//! chart with a real helm (fetched from the npm registry when none is installed) and
//! checks what it renders with `sluice check`; `scripts/check-image` builds the image
//! with buildah and runs it. Each of the last two is skipped, saying why, where its
//! tools cannot be had.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::process::RunWithin;
use serde_json::Value;

const CHILD_DEADLINE: Duration = Duration::from_secs(60);

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> PathBuf {
    root().join("deploy/helm/sluice")
}

/// Runs `cmd` to completion and fails the test, with its output, unless it succeeded.
fn succeeds(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.run_within(CHILD_DEADLINE);
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Chart.yaml, values.yaml and every manifest the chart can render, as JSON.
fn rendered() -> Value {
    let json = succeeds(
        Command::new("python3")
            .arg(root().join("deploy/helm/check.py"))
            .arg(chart()),
    );
    serde_json::from_slice(&json).unwrap()
}

fn of_kind<'a>(all: &'a Value, kind: &str) -> Vec<&'a Value> {
    all["docs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == kind)
        .collect()
}

#[test]
fn the_chart_has_probes_a_service_config_secrets_and_a_service_monitor() {
    let all = rendered();
    assert_eq!(all["chart"]["apiVersion"], "v2");
    assert_eq!(all["chart"]["name"], "sluice");
    let version = all["chart"]["appVersion"].as_str().unwrap();
    assert_eq!(
        version,
        env!("CARGO_PKG_VERSION"),
        "appVersion follows the crate"
    );

    let deployments = of_kind(&all, "Deployment");
    assert_eq!(deployments.len(), 1);
    let pod = &deployments[0]["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    let env: Vec<&str> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(env.contains(&"SLUICE_CONFIG"), "{env:?}");
    let password = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "SLUICE_REDIS_PASSWORD")
        .expect("the Redis password comes from the environment");
    assert!(
        password["valueFrom"]["secretKeyRef"].is_object(),
        "the Redis password comes from a Secret: {password}"
    );
    let ports: Vec<&Value> = c["ports"].as_array().unwrap().iter().collect();
    assert!(ports.iter().any(|p| p["name"] == "proxy"));
    assert!(ports.iter().any(|p| p["name"] == "admin"));

    let services = of_kind(&all, "Service");
    assert_eq!(services.len(), 1);
    let names: Vec<&Value> = services[0]["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["name"])
        .collect();
    assert_eq!(names, ["proxy", "admin"]);
    assert_eq!(of_kind(&all, "ConfigMap").len(), 1);
    // Optional Secrets: the Redis password, the interception CA, the users file, the
    // admin token.
    let secrets = of_kind(&all, "Secret");
    assert_eq!(secrets.len(), 4);
    for key in ["password", "ca.key", "users", "token"] {
        assert!(
            secrets.iter().any(|s| s["stringData"][key].is_string()),
            "a Secret with {key}"
        );
    }
    // Secret volumes are root's: sluice (10001) reads them through the pod's group.
    assert_eq!(pod["securityContext"]["fsGroup"], 10001);
    for v in pod["volumes"].as_array().unwrap() {
        if v["secret"].is_object() {
            assert_eq!(v["secret"]["defaultMode"], 0o440, "{v}");
        }
    }
    let monitors = of_kind(&all, "ServiceMonitor");
    assert_eq!(monitors.len(), 1);
    assert_eq!(monitors[0]["spec"]["endpoints"][0]["path"], "/metrics");
    assert_eq!(monitors[0]["spec"]["endpoints"][0]["port"], "admin");
    assert_eq!(all["values"]["serviceMonitor"]["enabled"], false);
}

/// Runs `scripts/<name>` with `args` and the test's sluice binary; `None`, having
/// printed why, when it says it skipped (exit 77: its tools cannot be had here).
fn script(name: &str, args: &[&str], deadline: Duration) -> Option<String> {
    let out = Command::new(root().join("scripts").join(name))
        .args(args)
        .env("SLUICE_BIN", env!("CARGO_BIN_EXE_sluice"))
        .run_within(deadline);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(77) {
        eprintln!("{name} skipped:\n{stderr}");
        return None;
    }
    assert!(out.status.success(), "{name} failed:\n{stdout}{stderr}");
    Some(format!("{stdout}{stderr}"))
}

/// The path of a real helm: installed, cached or fetched by `scripts/check-chart`.
fn helm() -> Option<PathBuf> {
    let out = script("check-chart", &["--print-helm"], Duration::from_secs(300))?;
    out.lines().next().map(PathBuf::from)
}

/// YAML documents as JSON (python3's PyYAML, as check.py uses).
fn yaml_docs(text: &str) -> Vec<Value> {
    let out = common::process::output_with_stdin(
        Command::new("python3").args([
            "-c",
            "import json,sys,yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ]),
        Some(text.as_bytes()),
        CHILD_DEADLINE,
    );
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The sluice.toml of the chart rendered by a real helm with `sets`.
fn rendered_config(helm: &Path, sets: &[&str]) -> String {
    let mut cmd = Command::new(helm);
    cmd.args(["template", "t"]).arg(chart());
    for s in sets {
        cmd.args(["--set", s]);
    }
    let text = String::from_utf8(succeeds(&mut cmd)).unwrap();
    yaml_docs(&text)
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["sluice.toml"].as_str())
        .expect("a ConfigMap with sluice.toml")
        .to_owned()
}

/// The chart lints and renders with a real helm, for its default values and with
/// interception, a users file, an admin token and a Redis password (given, or named
/// Secrets), and what it renders holds: `fsGroup` and 0440 Secret volumes, the Redis
/// password env only with its Secret, the config naming what the values turn on and
/// passing `sluice check` with the files it names; values it cannot honour fail at
/// render (scripts/check-chart).
#[test]
fn the_chart_renders_lints_and_passes_check_with_real_helm() {
    if let Some(out) = script("check-chart", &[], Duration::from_secs(300)) {
        for case in ["defaults", "everything", "existing_secrets", "refusals"] {
            assert!(out.contains(&format!("{case}: ok")), "{out}");
        }
    }
}

/// The image builds from the Dockerfile with a binary from the host and runs: `check`
/// of its example, `run` without a config refused, `run` of the example answering
/// /healthz and ending cleanly on SIGTERM (scripts/check-image, where buildah and
/// podman are installed; the debootstrapped base is cached after its first build).
#[test]
fn the_image_builds_and_runs_where_buildah_is_installed() {
    if let Some(out) = script("check-image", &[], Duration::from_secs(900)) {
        assert!(out.contains("/healthz 200: ok"), "{out}");
        assert!(out.contains("clean exit on SIGTERM: ok"), "{out}");
    }
}

/// deploy/kubernetes.yaml creates the namespace its objects live in, and its pod
/// reads Secret volumes through its group.
#[test]
fn the_kubernetes_manifest_creates_its_namespace() {
    let text = std::fs::read_to_string(root().join("deploy/kubernetes.yaml")).unwrap();
    let docs = yaml_docs(&text);
    let created: Vec<&str> = docs
        .iter()
        .filter(|d| d["kind"] == "Namespace")
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    for d in docs.iter().filter(|d| d["kind"] != "Namespace") {
        if let Some(ns) = d["metadata"]["namespace"].as_str() {
            assert!(
                created.contains(&ns),
                "{} uses {ns}, not created",
                d["kind"]
            );
        }
    }
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["fsGroup"], 10001);
}

/// The image has no default config: `run` without one says how to give it and exits 1
/// (a usage error).
#[test]
fn run_without_a_config_refuses_and_says_how_to_give_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("run")
        .env_remove("SLUICE_CONFIG")
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SLUICE_CONFIG"), "{err}");
    assert!(err.contains("--config"), "{err}");
}

/// The Dockerfile: a stripped binary on a slim base, a non-root user, the example
/// shipped but never run unless named.
#[test]
fn the_image_is_slim_non_root_and_has_no_default_config() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let stages: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    let last = stages.last().unwrap();
    assert!(
        last.contains("slim") || last.contains("distroless"),
        "{last}"
    );
    // The `dist` profile: fat LTO, stripped (Cargo.toml).
    assert!(text.contains("cargo build --profile dist"), "{text}");
    assert!(text.contains("COPY --from=binary /out/sluice /usr/local/bin/sluice"));
    // A binary built on the host goes in by a build argument, skipping the build stage.
    assert!(text.contains("ARG SLUICE_BINARY=build"), "{text}");
    assert!(text.contains("FROM ${SLUICE_BINARY} AS binary"), "{text}");
    let cargo: toml::Table = std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let dist = &cargo["profile"]["dist"];
    assert_eq!(dist["inherits"].as_str(), Some("release"));
    assert_eq!(dist["lto"].as_str(), Some("fat"));
    assert_eq!(dist["strip"].as_str(), Some("symbols"));
    let user = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    let uid = user.trim().split(':').next().unwrap();
    assert!(uid.parse::<u32>().is_ok_and(|uid| uid != 0), "{user}");
    let cmd = text.lines().rev().find(|l| l.starts_with("CMD ")).unwrap();
    assert_eq!(cmd, r#"CMD ["run"]"#);
    assert!(!text.contains("ENV SLUICE_CONFIG"));
    assert!(text.contains("/etc/sluice/example.toml"));
}

/// The `(alert, expr)` pairs of docs/operations.md's Prometheus rules, each expression
/// with its whitespace collapsed.
fn documented_alerts() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let block = doc
        .split("## Alerts (Prometheus rules)\n```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the rules block in docs/operations.md");
    let mut out: Vec<(String, String)> = Vec::new();
    let mut lines = block.lines().peekable();
    while let Some(line) = lines.next() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("- alert: ") {
            out.push((name.to_owned(), String::new()));
        } else if let Some(expr) = line.strip_prefix("expr: ") {
            let mut e = expr.to_owned();
            if e == "|" {
                e.clear();
                while let Some(next) = lines.peek() {
                    let t = next.trim();
                    if t.starts_with("for:") || t.starts_with("annotations:") || t.starts_with('-')
                    {
                        break;
                    }
                    e.push_str(t);
                    e.push(' ');
                    lines.next();
                }
            }
            out.last_mut().expect("an expr after its alert").1 = collapse(&e);
        }
    }
    out
}

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The chart's optional PrometheusRule carries the alerts
/// docs/operations.md gives, by name and expression, and is off by default.
#[test]
fn the_charts_prometheus_rule_has_the_documented_alerts() {
    let all = rendered();
    assert_eq!(all["values"]["prometheusRule"]["enabled"], false);
    let rules = of_kind(&all, "PrometheusRule");
    assert_eq!(rules.len(), 1);
    let charted: Vec<(String, String)> = rules[0]["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_owned(),
                collapse(r["expr"].as_str().unwrap()),
            )
        })
        .collect();
    let documented = documented_alerts();
    assert!(documented.len() >= 7, "{documented:?}");
    assert_eq!(charted, documented);
}

/// The TOML of `deploy/kubernetes.yaml`'s ConfigMap (its `sluice.toml: |` block).
fn kubernetes_config() -> String {
    let text = std::fs::read_to_string(root().join("deploy/kubernetes.yaml")).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "sluice.toml: |");
    lines
        .next()
        .expect("a sluice.toml block in deploy/kubernetes.yaml");
    lines
        .take_while(|l| l.starts_with("    ") || l.is_empty())
        .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
        .collect()
}

/// Every config shipped for deployment listens beyond loopback (it must, in a pod or a
/// container) and is no open proxy: it names `allowed_hosts` or turns on proxy
/// authentication, so `check` passes it without the open-proxy warning and `run`
/// starts, without `allow_anonymous`.
#[test]
fn the_shipped_deploy_configs_are_not_open_proxies() {
    let mut shipped = vec![
        ("deploy/kubernetes.yaml", kubernetes_config()),
        (
            "deploy/sluice.redis.toml",
            std::fs::read_to_string(root().join("deploy/sluice.redis.toml")).unwrap(),
        ),
    ];
    match helm() {
        Some(helm) => {
            shipped.push(("the chart", rendered_config(&helm, &[])));
            shipped.push((
                "the chart with a Redis password",
                rendered_config(&helm, &["redis.password=pw"]),
            ));
        }
        None => eprintln!("no helm: the chart's rendered config is not checked here"),
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in shipped {
        let config = sluice::config::Config::parse_with_env(&text, &|_| Some("pw".into()))
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert!(
            !config.proxy.listen.ip().is_loopback(),
            "{name} listens beyond loopback"
        );
        assert_eq!(config.open_proxy(), None, "{name}");
        assert!(!config.security.allow_anonymous, "{name}");
        let path = dir.path().join("sluice.toml");
        std::fs::write(&path, &text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config"])
            .arg(&path)
            .env("SLUICE_REDIS_PASSWORD", "from-the-secret")
            .run_within(CHILD_DEADLINE);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {err}");
        assert!(!err.contains("open proxy"), "{name}: {err}");
    }
}
