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
