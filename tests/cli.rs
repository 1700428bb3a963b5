//! The `sluice` binary: `check` on good and bad files, `run` on a taken port, `ca init`.

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::RunWithin;

/// Longest any child process (curl, the sluice binary) may run before the test fails.
const CHILD_DEADLINE: Duration = Duration::from_secs(30);

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

#[test]
fn every_shipped_config_passes_check() {
    let mut checked = 0;
    for dir in ["config", "deploy"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                let out = sluice()
                    .args(["check", "--config"])
                    .arg(&path)
                    .run_within(CHILD_DEADLINE);
                assert!(
                    out.status.success(),
                    "{} fails check: {}",
                    path.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(String::from_utf8_lossy(&out.stdout).contains("ok:"));
                checked += 1;
            }
        }
    }
    assert!(checked >= 1, "no config files found");
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
            .output()
            .unwrap()
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
        cmd.output().unwrap()
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
