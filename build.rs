//! Stamps the binary with its git commit and build date (`sluice version`,
//! `sluice_build_info`). No dependencies: `git` when present, else "unknown".
//!
//! - `SLUICE_GIT_COMMIT` overrides the commit (builds from a tarball or a Docker context
//!   without `.git`).
//! - `SOURCE_DATE_EPOCH` (reproducible builds) overrides the build time.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!("cargo:rerun-if-env-changed=SLUICE_GIT_COMMIT");
    watch_git_head();
    let commit = std::env::var("SLUICE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    println!("cargo:rustc-env=SLUICE_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=SLUICE_BUILD_DATE={}", rfc3339(epoch));
}

/// Re-run when HEAD moves (checkout, commit), not on every source change: the build
/// date is the time the commit stamp was last taken.
fn watch_git_head() {
    let mut paths = vec!["HEAD".to_owned()];
    if let Some(r) = git(&["rev-parse", "--symbolic-full-name", "HEAD"]) {
        paths.push(r);
    }
    paths.push("packed-refs".to_owned());
    for p in paths {
        // Only existing files: cargo re-runs every time for a missing one.
        if let Some(file) = git(&["rev-parse", "--git-path", &p]) {
            if std::path::Path::new(&file).is_file() {
                println!("cargo:rerun-if-changed={file}");
            }
        }
    }
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !s.is_empty()).then_some(s)
}

/// `YYYY-MM-DDTHH:MM:SSZ` from Unix seconds (Howard Hinnant's days-to-civil).
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
