//! What build this is: version, git commit and build date, stamped by `build.rs`.

/// The crate version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Short git commit of the build, or `unknown` outside a git checkout.
pub const COMMIT: &str = env!("SLUICE_GIT_COMMIT");
/// Build time, `YYYY-MM-DDTHH:MM:SSZ` (`SOURCE_DATE_EPOCH` when set).
pub const BUILD_DATE: &str = env!("SLUICE_BUILD_DATE");
/// `0.1.0 (commit abc1234, built 2025-01-01T00:00:00Z)`, as `sluice --version` prints it.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SLUICE_GIT_COMMIT"),
    ", built ",
    env!("SLUICE_BUILD_DATE"),
    ")"
);
